"""Replicas that follow a leader (server/follow.py): one leader and two followers on loopback, on the tiny model.

Adapters are hand-made GGUF LoRAs with random factors (test_adapters_many.lora_file), imported and promoted
on the leader over HTTP: each changes the greedy answer, so "served by every replica" is checked on the
answer itself, beside the served version ids. Nothing trains.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from background_server import BackgroundServer
from test_adapters_many import b64, complete, lora_file, settings, text

from dreamstage import cli
from dreamstage.server.adapter_routes import CHANGE_POLL_S
from dreamstage.server.settings import ServerSettings

KEY = "leader-key"
READER_KEY = "reader-key"          # scoped: reads alice, bob and carol, trains nothing
INTERVAL_S = 1.0
# The stated bound on a promotion reaching a follower in sync: the leader's look at its store, a download of a
# few KiB and one decode batch on each side, well under a second on loopback; INTERVAL_S + 2 s leaves room
# for a loaded 2-core runner.
BOUND_S = INTERVAL_S + 2.0
NAMES = ("alice", "bob", "carol")


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return {f"{n}{v}": lora_file(d / f"{n}{v}.gguf", seed) for seed, (n, v) in
            enumerate(((n, v) for n in NAMES for v in (1, 2)), start=10)}


@pytest.fixture
def cluster(tiny_model_path, tmp_path):
    """A leader (its key, and a scoped key that reads the adapters) and two followers, one on each key."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({READER_KEY: {"adapters": list(NAMES), "train": False}}))
    leader = BackgroundServer(settings(tiny_model_path, tmp_path / "leader", api_key=KEY, api_keys=str(keys)))
    # the first follower has keys of its own too (clients use them as on the leader)
    followers = [BackgroundServer(follower_settings(tiny_model_path, tmp_path / "f0", leader.url, KEY, api_key=KEY,
                                                    api_keys=str(keys))),
                 BackgroundServer(follower_settings(tiny_model_path, tmp_path / "f1", leader.url, READER_KEY))]
    http = httpx.Client(base_url=leader.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    try:
        yield leader, followers, http
    finally:
        http.close()
        for s in (*followers, leader):
            s.close()


def follower_settings(tiny_model_path, state_dir, leader_url: str, key: str | None, **kw):
    return settings(tiny_model_path, state_dir, follow=leader_url, follow_key=key, follow_interval=INTERVAL_S, **kw)


def served(server) -> dict[str, tuple[int, int]]:
    """What a server serves: {name: (version, served_version)}, from its store."""
    store = server.service.store
    return {n: (v["version"], v["served_version"]) for n in store.resident_names() for v in [store.served(n)]}


def wait_for(followers, want: dict, timeout_s: float) -> float:
    """Seconds until every follower serves `want` and has ended that round (applied, in sync); fails naming
    what they serve past `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if all(served(f) == want and f.service.follower.state == "in_sync" for f in followers):
            return time.monotonic() - t0
        time.sleep(0.02)
    states = [follow_status(f) for f in followers]
    raise AssertionError(f"followers serve {[served(f) for f in followers]}, not {want}, after {timeout_s} s: "
                         f"{states}")


def answers(server, models=("alice", "bob", None, "base")) -> dict:
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as h:
        out = {}
        for m in models:
            r = complete(h, m)
            out[m] = (text(r), r.json()["adapter_version"]) if r.status_code == 200 else r.status_code
        return out


def promote_new(http, name: str, path) -> None:
    r = http.post("/adapters", json={"name": name, "gguf": b64(path)})
    assert r.status_code == 201, r.text


def test_a_promotion_reaches_both_followers_within_the_bound_and_they_answer_as_the_leader(cluster, loras,
                                                                                         record_result):
    leader, followers, http = cluster
    base = answers(leader, ("base",))
    delays = []
    for name in ("alice", "bob"):
        promote_new(http, name, loras[f"{name}1"])
        delays.append(wait_for(followers, served(leader), BOUND_S))
    assert set(served(leader)) == {"alice", "bob"}
    want = answers(leader)
    assert want["alice"][0] != base["base"][0] and want["bob"][0] != want["alice"][0]
    assert want[None] == want["bob"] and want["bob"][1] == served(leader)["bob"][1]
    for f in followers:
        assert answers(f) == want            # the same greedy answers and served version ids
        health = httpx.get(f.url + "/health").json()
        assert health["status"] == "ok" and health["adapter_version"] == want["bob"][1]
        follow = health["follow"]
        assert follow["leader"] == leader.url and follow["state"] == "in_sync"
        assert follow["lag_s"] <= INTERVAL_S + 1.0 and follow["last_sync"] <= time.time()
        assert follow["served_versions"] == sorted(sv for _, sv in served(leader).values())
        assert "served" not in follow and "error" not in follow       # /health is open: it names no adapter
        detail = follow_status(f)                                     # GET /adapters, the server's key
        assert detail["error"] is None and {(s["name"], s["version"], s["served_version"]) for s in
                                            detail["served"]} == {(n, v, sv) for n, (v, sv) in served(leader).items()}
    metrics = httpx.get(followers[1].url + "/metrics").text
    assert "dreamstage_follow_in_sync 1.0" in metrics and "dreamstage_follow_refused_downloads_total 0.0" in metrics
    assert "dreamstage_follow_lag_seconds " in metrics
    scoped = httpx.get(followers[0].url + "/adapters", headers={"Authorization": f"Bearer {READER_KEY}"}).json()
    assert "served" not in scoped["follow"] and scoped["follow"]["state"] == "in_sync"
    record_result("follow_delay", {"followers": 2, "follow_interval_s": INTERVAL_S, "change_poll_s": CHANGE_POLL_S,
                                   "bound_s": BOUND_S, "delays_s": [round(d, 3) for d in delays]})


def test_the_leaders_long_poll_answers_at_a_change_or_after_its_wait(cluster, loras):
    leader, followers, http = cluster
    r = http.get("/adapters")
    g = r.json()["generation"]
    assert r.headers["etag"] == f'"{g}"'
    t0 = time.monotonic()
    assert http.get("/adapters", params={"since": g, "wait": 0.3}).json()["generation"] == g
    assert 0.3 <= time.monotonic() - t0 < 0.3 + 1.0
    assert http.get("/adapters", params={"since": g + 5, "wait": 30}).json()["generation"] == g   # differs: at once
    waited: dict = {}

    def poll():
        t = time.monotonic()
        waited["view"] = http.get("/adapters", params={"since": g, "wait": 30}).json()
        waited["at"] = time.monotonic() - t
    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.3)
    promote_new(http, "alice", loras["alice1"])
    t.join(10)
    assert waited["view"]["generation"] > g and 0.3 <= waited["at"] < 0.3 + BOUND_S
    assert [p["name"] for n in waited["view"]["names"] for p in n["promotions"]] == ["alice"]
    sha = waited["view"]["adapters"][0]["sha256"]
    assert http.get("/adapters/alice/versions/1").headers["x-dreamstage-sha256"] == sha
    for params, param in (({"since": "-1"}, "since"), ({"since": "x"}, "since"), ({"since": 0, "wait": "999"}, "wait"),
                          ({"since": 0, "wait": "soon"}, "wait")):
        r = http.get("/adapters", params=params)
        assert r.status_code == 422 and r.json()["error"]["param"] == param


def test_rollbacks_and_unloads_on_the_leader_are_followed(cluster, loras):
    leader, followers, http = cluster
    promote_new(http, "alice", loras["alice1"])
    promote_new(http, "alice", loras["alice2"])
    promote_new(http, "bob", loras["bob1"])
    wait_for(followers, served(leader), BOUND_S)
    two = answers(leader)
    assert http.post("/adapters/alice/rollback").status_code == 200
    assert served(leader)["alice"][0] == 1
    wait_for(followers, served(leader), BOUND_S)
    one = answers(leader)
    assert one["alice"] != two["alice"] and one["bob"] == two["bob"]
    for f in followers:
        assert answers(f) == one
    # a version stored on the leader but never promoted is not the followers' to serve, pinned or not
    r = http.post("/adapters", json={"name": "bob", "gguf": b64(loras["bob2"]), "promote": False})
    assert r.status_code == 201 and r.json()["imported"]["version"] == 2
    assert answers(leader, ("bob@2",))["bob@2"][0] != one["bob"][0]
    time.sleep(INTERVAL_S)
    for f in followers:
        assert answers(f, ("bob@2",))["bob@2"] == 404 and not f.service.store.adapter_path("bob", 2).exists()
    assert http.delete("/adapters/bob").status_code == 200          # every promotion of bob rolled back
    wait_for(followers, served(leader), BOUND_S)
    assert set(served(leader)) == {"alice"}
    for f in followers:
        assert answers(f, ("alice", "bob", None)) == answers(leader, ("alice", "bob", None))
        assert answers(f, ("bob",))["bob"] == 404


def test_a_follower_restarted_during_a_promotion_converges(cluster, loras, tiny_model_path, tmp_path):
    leader, followers, http = cluster
    promote_new(http, "alice", loras["alice1"])
    wait_for(followers, served(leader), BOUND_S)
    before = served(leader)
    promote_new(http, "bob", loras["bob1"])
    followers[1].close()                     # while it may be fetching bob or booking it
    promote_new(http, "carol", loras["carol1"])
    assert http.post("/adapters/alice/promote", json={"version": 1}).status_code == 200
    after = served(leader)
    restarted = BackgroundServer(follower_settings(tiny_model_path, tmp_path / "f1", leader.url, READER_KEY))
    followers[1] = restarted
    # from the moment it starts it serves a set the leader promoted: what its state directory kept (before, or
    # with bob), or already the leader's set now
    assert served(restarted) in (before, {**before, "bob": after["bob"]}, after)
    wait_for(followers, served(leader), INTERVAL_S + BOUND_S)
    assert answers(restarted, ("alice", "bob", "carol", None)) == answers(leader, ("alice", "bob", "carol", None))


class TamperingProxy:
    """A loopback HTTP proxy to the leader that, while `tamper` is set, flips the last bytes of every adapter
    download (and passes the leader's headers, its published sha256 among them, unchanged); while
    `partitioned` is set, it closes every connection unanswered."""

    def __init__(self, upstream: str):
        proxy = self
        self.tamper, self.partitioned, self.upstream = True, False, upstream

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization",)}
                r = None if proxy.partitioned else httpx.get(proxy.upstream + self.path, headers=headers,
                                                               timeout=120)
                if r is None or proxy.partitioned:       # the link is down: the connection closes unanswered
                    self.close_connection = True
                    return
                body = r.content
                if proxy.tamper and "/versions/" in self.path:
                    body = body[:-16] + bytes(b ^ 0xFF for b in body[-16:])
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() in ("content-type", "x-dreamstage-sha256", "etag"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_tampered_download_is_refused_logged_never_served_and_retried(cluster, loras, tiny_model_path, tmp_path,
                                                                        caplog):
    leader, followers, http = cluster
    promote_new(http, "alice", loras["alice1"])
    proxy = TamperingProxy(leader.url)
    state = tmp_path / "behind-proxy"
    try:
        with BackgroundServer(follower_settings(tiny_model_path, state, proxy.url, KEY)) as tampered:
            health = wait_follow(tampered, lambda f: f["refused_downloads"] >= 1, BOUND_S)
            assert health["state"] == "failing" and "sha256" in health["error"] and "refused" in health["error"]
            assert "dreamstage_follow_in_sync 0.0" in httpx.get(tampered.url + "/metrics").text
            assert any("refused, not served" in r.getMessage() for r in caplog.records
                       if r.name == "dreamstage.follow")
            # nothing of the refused set serves: not alice, whose file never landed, and no file is kept
            assert served(tampered) == {} and not (state / "adapters" / "alice" / "v1.gguf").exists()
            assert answers(tampered, ("alice",))["alice"] == 404
            assert answers(tampered, ("base",)) == answers(leader, ("base",))
            wait_follow(tampered, lambda f: f["refused_downloads"] >= 2, INTERVAL_S + BOUND_S)   # retried
            proxy.tamper = False
            wait_for([tampered], served(leader), INTERVAL_S + BOUND_S)
            assert answers(tampered) == answers(leader)
            assert follow_status(tampered)["state"] == "in_sync"
            # a partition: the leader promotes meanwhile; the follower serves its last set, then catches up
            proxy.partitioned = True
            before = served(tampered)
            promote_new(http, "bob", loras["bob1"])
            follow = wait_follow(tampered, lambda f: f["state"] == "unreachable", INTERVAL_S + BOUND_S)
            assert "unreachable" in follow["error"] and served(tampered) == before
            since = follow["unreachable_since"]
            assert since is not None and since <= time.time() and follow["failed_polls"] >= 1
            time.sleep(INTERVAL_S)
            later = follow_status(tampered)
            assert later["lag_s"] > INTERVAL_S and later["unreachable_since"] == since
            # still serving its last set (200), and saying since when and how often the leader did not answer
            health = httpx.get(tampered.url + "/health")
            assert health.status_code == 200, health.text
            assert health.json()["follow"]["state"] == "unreachable"
            assert health.json()["follow"]["unreachable_since"] == since
            assert health.json()["follow"]["failed_polls"] >= later["failed_polls"] > follow["failed_polls"]
            metrics = httpx.get(tampered.url + "/metrics").text
            assert "dreamstage_follow_leader_reachable 0.0" in metrics
            assert "dreamstage_follow_unreachable_seconds" in metrics and "dreamstage_follow_failed_polls" in metrics
            proxy.partitioned = False
            wait_for([tampered], served(leader), INTERVAL_S + BOUND_S)
            assert answers(tampered) == answers(leader)
            back = wait_follow(tampered, lambda f: f["state"] == "in_sync", BOUND_S)
            assert back["unreachable_since"] is None and back["failed_polls"] == 0
            metrics = httpx.get(tampered.url + "/metrics").text
            assert "dreamstage_follow_leader_reachable 1.0" in metrics
            assert "dreamstage_follow_unreachable_seconds" not in metrics
    finally:
        proxy.close()


def follow_status(server) -> dict:
    """A follower's detailed follow status (GET /adapters with the server's key, if it has one)."""
    r = httpx.get(server.url + "/adapters", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["follow"]


def wait_follow(server, ok, timeout_s: float) -> dict:
    t0 = time.monotonic()
    while True:
        follow = follow_status(server)
        if ok(follow):
            return follow
        assert time.monotonic() - t0 < timeout_s, follow
        time.sleep(0.05)


def test_a_follower_refuses_training_and_adapter_changes_with_409_naming_the_leader(cluster, loras):
    leader, followers, http = cluster
    promote_new(http, "alice", loras["alice1"])
    wait_for(followers, served(leader), BOUND_S)
    f = followers[1]
    calls = [("POST", "/train", {"examples": [{"text": "hi"}]}), ("POST", "/v1/feedback", {"id": "x", "rating": 1}),
             ("POST", "/adapters", {"name": "dave", "gguf": b64(loras["bob1"])}),
             ("POST", "/adapters/alice/promote", {}), ("POST", "/adapters/alice/rollback", None),
             ("POST", "/adapters/rollback", None), ("DELETE", "/adapters/alice", None),
             ("PUT", "/adapters/alice/learn", {"mode": "auto"}), ("POST", "/train/1/cancel", None)]
    for method, path, body in calls:
        r = httpx.request(method, f.url + path, json=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 409, (method, path, r.text)
        err = r.json()["error"]
        assert err["code"] == "follower" and err["leader"] == leader.url and leader.url in err["message"]
        assert r.headers["x-dreamstage-leader"] == leader.url
    keyed = followers[0]                                  # the guard sits inside the key check
    assert httpx.post(keyed.url + "/train", json={"text": "hi"}).status_code == 401
    r = httpx.post(keyed.url + "/train", json={"text": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 409 and r.json()["error"]["leader"] == leader.url
    assert served(f) == served(leader)                   # nothing changed
    assert answers(f, ("alice",)) == answers(leader, ("alice",))     # serving works as usual
    r = httpx.post(f.url + "/v1/chat/completions", json={"model": "alice", "max_tokens": 4, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["adapter"] == "alice@1"
    assert httpx.get(f.url + "/adapters").status_code == 200          # reading stays open


def test_a_bad_follow_url_key_or_state_dir_is_a_clear_error(tiny_model_path, tmp_path, cluster, loras, capsys):
    leader, followers, http = cluster
    promote_new(http, "alice", loras["alice1"])
    for url, says in (("ftp://leader:8080", "expected http://HOST[:PORT]"), ("leader:8080", "expected http://"),
                      ("http://u:secret@leader", "--follow-key"), ("http://leader:99999", "not a URL"),
                      ("http://leader/?x=1", "no query")):
        with pytest.raises(ValueError, match="follow") as e:
            follower_settings(tiny_model_path, tmp_path / "s", url, None)
        assert says in str(e.value)
        assert cli.main(["serve", "--follow", url, "--state-dir", str(tmp_path / "s")]) == 2
        assert "follow" in capsys.readouterr().err
    assert cli.main(["serve", "--follow", leader.url, "--no-train"]) == 2
    assert "state directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a state directory of its own"):     # the leader's, say
        BackgroundServer(follower_settings(tiny_model_path, tmp_path / "leader", leader.url, KEY))
    with pytest.raises(ValueError, match="itself a follower"):
        BackgroundServer(follower_settings(tiny_model_path, tmp_path / "chain", followers[0].url, KEY))
    with pytest.raises(ValueError, match="refused the key"):
        BackgroundServer(follower_settings(tiny_model_path, tmp_path / "k", leader.url, "wrong-key"))
    with BackgroundServer(ServerSettings(model=str(tiny_model_path), ctx=1024, threads=1)) as no_train:
        with pytest.raises(ValueError, match="not a dreamstage leader"):
            BackgroundServer(follower_settings(tiny_model_path, tmp_path / "n", no_train.url, None))
    # an unreachable leader is a partition, not a bad flag: the follower starts, says so, and serves the base
    with BackgroundServer(follower_settings(tiny_model_path, tmp_path / "u", "http://127.0.0.1:9", None)) as lone:
        follow = follow_status(lone)
        assert follow["state"] == "unreachable" and "unreachable" in follow["error"] and follow["served"] == []
        assert httpx.get(lone.url + "/health").json()["follow"]["served_versions"] == []
        assert answers(lone, ("base",)) == answers(leader, ("base",))
