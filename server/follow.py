"""A follower replica (`dreamstage serve --follow URL`): it serves the adapter versions promoted on the
leader, and only those.

The leader is any dreamstage server with training on. The follower keeps its own state directory: the
leader's adapter files it fetched, and its promotions table, which holds the leader's live promotions under
the leader's own served-version numbers (so both answer with the same `adapter_version`). That table is the
follow state: after a restart the follower serves what it served before, then catches up.

One thread, the follow channel, loops:
1. `GET /adapters?since=G&wait=S` on the leader (a long poll: it answers once the leader's promotion
   generation is not G, or after S = --follow-interval seconds) gives the leader's live promotions and each
   stored version's sha256;
2. each (name, version) it does not hold is fetched through the export route
   (`GET /adapters/{name}/versions/{v}`) into a temporary file, and kept only if its sha256 is the one the
   listing published; a mismatch is refused, logged and retried after S seconds, and the file is never
   loaded;
3. once every file is in place, the engine thread books the whole set at once (`DreamScheduler.mirror`:
   promotions and rollbacks of the leader between two polls land together, checked by llama.cpp's loader as
   a promotion is) and applies it between two batches.
A failure (leader unreachable, a refused file, an adapter the follower cannot hold) leaves the follower
serving the last set it applied, which the leader promoted, and the loop retries after S seconds.

Delay: a promotion on the leader is served by a follower in sync within CHANGE_POLL_S (the leader's look
at its store) + the download + one decode batch on each side; after a failure, within S more.

The follow channel sends --follow-key as the bearer key: the leader's own key, or a scoped key that reads
the adapters (a scoped key follows its names only). On a follower, the routes that train or change
adapters answer 409 naming the leader (`FollowerGuard`); serving is as on any server.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import re
import sqlite3
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from dreamstage.adapters.files import atomic_file, file_sha256
from dreamstage.server.errors import error_body
from dreamstage.training.jobs.request import check_adapter_name

log = logging.getLogger("dreamstage.follow")

# Beyond the long poll's own wait: how long an answer from the leader may take (the poll, a download's chunk).
READ_MARGIN_S = 10.0
CONNECT_TIMEOUT_S = 5.0
# How long the follower waits for its engine thread to book, then to apply, a change of the served set.
APPLY_WAIT_S = 30.0
LEADER_HEADER = "X-Dreamstage-Leader"
# What a follower refuses (any method but GET/HEAD/OPTIONS): training, feedback and adapter changes.
REFUSED_PREFIXES = ("/train", "/adapters", "/v1/feedback")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# In a follower's state directory: it holds only adapters fetched from a leader.
MARKER = "follower.json"


class FollowError(RuntimeError):
    """One round of the follow channel failed; the follower keeps what it serves and retries."""


class TamperedDownload(FollowError):
    """A fetched adapter's bytes do not have the sha256 the leader published."""


def check_leader_url(url: str) -> str:
    """`url` as http[s]://host[:port][/prefix]; ValueError naming `follow` otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"follow {url!r}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"follow {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT] of the leader")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"follow {url!r}: give the leader's key with --follow-key (or DREAMSTAGE_FOLLOW_KEY), "
                         "not in the URL")
    if parts.query or parts.fragment:
        raise ValueError(f"follow {url!r}: the leader's URL takes no query or fragment")
    del port                                    # parsed only to refuse a bad port
    return url


class FollowerGuard:
    """ASGI middleware of a follower: training, feedback and adapter changes answer 409 naming the leader."""

    def __init__(self, app, leader: str):
        self.app, self.leader = app, leader

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS") \
                and scope["path"].startswith(REFUSED_PREFIXES):
            body = error_body(409, f"this server follows {self.leader}: train, give feedback and change adapters "
                                   "there; this one serves what it promotes", None, "follower")
            body["error"]["leader"] = self.leader
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": 409,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data)),
                                    (LEADER_HEADER.lower().encode(), self.leader.encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        await self.app(scope, receive, send)


class Follower:
    """The follow channel of one server (`Service.follower`): a thread from `start` to `close`."""

    def __init__(self, service, leader: str, key: str | None, interval_s: float):
        self.service, self.store, self.leader, self.interval_s = service, service.store, leader, interval_s
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=leader.rstrip("/"), headers=headers,
                                  timeout=httpx.Timeout(interval_s + READ_MARGIN_S, connect=CONNECT_TIMEOUT_S))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.state = "starting"            # starting, syncing, in_sync, unreachable, failing
        self.generation: int | None = None    # the leader's generation the served set matches
        self.last_sync: float | None = None   # when the follower last confirmed it serves the leader's set
        self.error: str | None = None
        self.refused_downloads = 0
        self.failed_polls = 0                 # rounds failed since the last one that succeeded
        self.unreachable_since: float | None = None   # when the leader stopped answering (None: it answers)

    # -- lifecycle ----------------------------------------------------------------------------
    def probe(self) -> None:
        """Check the state directory, the URL and the key once, at startup: ValueError for a state directory
        that holds adapters or jobs of its own, a leader that refuses the key, or a URL that is no dreamstage
        leader (or is a follower); an unreachable leader only warns (the follower serves its last set meanwhile)."""
        self._claim_state_dir()
        try:
            r = self._http.get("/adapters", timeout=httpx.Timeout(CONNECT_TIMEOUT_S + READ_MARGIN_S))
        except httpx.HTTPError as e:
            self._failed("unreachable", f"the leader {self.leader} is unreachable: {e!r}")
            return
        if r.status_code in (401, 403):
            raise ValueError(f"follow: the leader {self.leader} refused the key ({r.status_code}): set --follow-key "
                             "(or DREAMSTAGE_FOLLOW_KEY) to its API key, or a key that reads its adapters")
        view = _json(r) if r.status_code == 200 else None
        if not isinstance(view, dict) or "generation" not in view:
            raise ValueError(f"follow: {self.leader} is not a dreamstage leader with training on "
                             f"(GET /adapters answered {r.status_code}: {r.text[:200]!r})")
        if isinstance(view.get("follow"), dict):    # its generation is its own, not its leader's
            raise ValueError(f"follow: {self.leader} is itself a follower (of {view['follow'].get('leader')}); "
                             "follow its leader")

    def _claim_state_dir(self) -> None:
        """Every adapter a follower holds came from a leader, so that it never serves one the leader did not
        promote: a state directory is a follower's (MARKER) or empty, and becomes a follower's."""
        marker = self.store.state_dir / MARKER
        if not marker.exists():
            if self.store.names() or self.store.job_ids(1):
                raise ValueError(f"follow: the state directory {self.store.state_dir} holds adapters or jobs of its "
                                 "own; a follower needs a state directory of its own (a new one, or a follower's)")
            with atomic_file(marker) as tmp:
                tmp.write_text(json.dumps({"follows": self.leader}) + "\n")

    def start(self) -> Follower:
        self._thread = threading.Thread(target=self._run, name="dreamstage-follow", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._http.close()                  # ends a long poll in flight
        if self._thread is not None:
            self._thread.join(APPLY_WAIT_S)

    def status(self, detail: bool) -> dict:
        """The leader, the channel's state, its lag and the served versions (the leader's numbers). With
        `detail` (GET /adapters, an unscoped key) also the last error and each served adapter by name; /health,
        open to all, names no adapter."""
        with self._lock:
            last = self.last_sync
            out: dict[str, Any] = {"leader": self.leader, "state": self.state, "generation": self.generation,
                   "last_sync": last, "lag_s": None if last is None else round(time.time() - last, 3),
                   "refused_downloads": self.refused_downloads, "failed_polls": self.failed_polls,
                   "unreachable_since": self.unreachable_since}
            error = self.error
        served = [v for n in self.store.resident_names() for v in [self.store.served(n)] if v is not None]
        out["served_versions"] = sorted(v["served_version"] for v in served)
        if detail:
            out["error"] = error
            out["served"] = [{k: v[k] for k in ("name", "version", "served_version", "sha256")} for v in served]
        return out

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        since: int | None = None
        while not self._stop.is_set():
            try:
                since = self.sync(since)
            except Exception as e:  # the channel outlives any one bad round
                if self._stop.is_set():
                    return                  # closed under a request in flight
                if isinstance(e, FollowError):
                    unreachable = isinstance(e.__cause__, httpx.TransportError)
                    self._failed("unreachable" if unreachable else "failing", str(e),
                                 refused=isinstance(e, TamperedDownload))
                else:
                    log.exception("follow: unexpected failure")
                    self._failed("failing", f"{type(e).__name__}: {e}")
                since = None                # a fresh snapshot next time
                self._stop.wait(self.interval_s)

    def sync(self, since: int | None) -> int:
        """One round: wait for the leader's set to change from `since` (None: now), fetch what is missing,
        serve the set. Returns the leader's generation now served; FollowError otherwise."""
        view = self._poll(since)
        live, shas, generation = _leader_state(view)
        local = {(p["served_version"], p["name"], p["version"]) for p in self.store.promotions()}
        if set(live) != local:
            with self._lock:
                self.state = "syncing"
            for name, version in sorted({(n, v) for sv, n, v in live if (sv, n, v) not in local}):
                self._ensure_file(name, version, shas.get((name, version)))
            self._apply(live)
            log.info("follow: serving the leader's generation %d: %s", generation,
                     ", ".join(f"{n} v{v} (served version {sv})" for sv, n, v in live) or "the base model")
        with self._lock:
            self.state, self.generation, self.last_sync, self.error = "in_sync", generation, time.time(), None
            self.failed_polls = 0
        return generation

    def _poll(self, since: int | None) -> dict:
        params = {} if since is None else {"since": str(since), "wait": f"{self.interval_s:g}"}
        try:
            r = self._http.get("/adapters", params=params)
        except httpx.TransportError as e:
            raise FollowError(f"the leader {self.leader} is unreachable: {e!r}") from e
        except httpx.HTTPError as e:
            raise FollowError(f"the leader {self.leader} did not answer GET /adapters: {e!r}") from e
        with self._lock:
            self.unreachable_since = None       # it answered (whatever it said)
        if r.status_code != 200:
            raise FollowError(f"the leader {self.leader} answered GET /adapters with {r.status_code}: {r.text[:200]}")
        view = _json(r)
        if not isinstance(view, dict):
            raise FollowError(f"the leader {self.leader} answered GET /adapters with no JSON object")
        return view

    def _ensure_file(self, name: str, version: int, sha256: str | None) -> None:
        """The leader's (name, version) stored here with the bytes whose sha256 it published; fetched if need be."""
        if sha256 is None:
            raise FollowError(f"the leader published no sha256 for {name} v{version}; not fetched")
        held = next((a for a in self.store.adapters(name) if a["version"] == version), None)
        path = self.store.adapter_path(name, version)
        if held is not None and held["sha256"] != sha256:
            raise FollowError(f"{name} v{version} in this follower's state directory is not the leader's "
                              f"(sha256 {held['sha256']} here, {sha256} there): start it with a state directory "
                              "of its own")
        if held is not None and path.is_file() and file_sha256(path) == sha256:
            return
        self._download(name, version, sha256, path)
        if held is None:
            try:
                self.store.add_adapter(name, version)
            except (OSError, sqlite3.Error) as e:
                raise FollowError(f"{name} v{version} could not be recorded: {e}") from e

    def _download(self, name: str, version: int, sha256: str, path) -> None:
        digest = hashlib.sha256()
        try:
            with atomic_file(path) as tmp, open(tmp, "wb") as out:
                with self._http.stream("GET", f"/adapters/{name}/versions/{version}") as r:
                    if r.status_code != 200:
                        raise FollowError(f"the leader answered GET /adapters/{name}/versions/{version} with "
                                          f"{r.status_code}")
                    for chunk in r.iter_bytes():
                        digest.update(chunk)
                        out.write(chunk)
                out.flush()
                if digest.hexdigest() != sha256:
                    raise TamperedDownload(f"{name} v{version} from {self.leader} has sha256 {digest.hexdigest()}, "
                                           f"not the {sha256} the leader published: refused, not served")
        except httpx.HTTPError as e:
            raise FollowError(f"fetching {name} v{version} from {self.leader} failed: {e!r}") from e
        except OSError as e:
            raise FollowError(f"{name} v{version} could not be written: {e}") from e

    def _apply(self, live: list[tuple[int, str, int]]) -> None:
        """Book the leader's set on the engine thread and wait until it serves."""
        if not self.service.engine.running:
            raise FollowError("the engine is not running")
        fut = self.service.scheduler.mirror(live)
        try:
            _, applied = fut.result(APPLY_WAIT_S)
            applied.result(APPLY_WAIT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise FollowError("the engine did not take the leader's set in time") from None
        except (ValueError, RuntimeError, OSError, sqlite3.Error) as e:   # refused, unloadable, not stored
            raise FollowError(f"the leader's set could not be served here: {e}") from e

    def _failed(self, state: str, message: str, refused: bool = False) -> None:
        with self._lock:                    # the state, error and count change together (status reads them)
            repeated = self.error == message
            self.state, self.error = state, message
            self.refused_downloads += refused
            self.failed_polls += 1
            if state == "unreachable" and self.unreachable_since is None:
                self.unreachable_since = time.time()
        if not repeated:
            log.error("follow: %s; serving what was served before, retrying every %g s", message, self.interval_s)


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return None


def _leader_state(view: dict) -> tuple[list[tuple[int, str, int]], dict[tuple[str, int], str], int]:
    """The leader's live promotions [(served_version, name, version)], the published sha256 of each stored
    (name, version), and its generation, from GET /adapters; FollowError for a malformed answer."""
    try:
        generation = view["generation"]
        live = sorted((p["served_version"], check_adapter_name(p["name"]), p["version"])
                      for n in view["names"] for p in n["promotions"])
        shas = {(a["name"], a["version"]): a["sha256"] for a in view["adapters"]}
    except (KeyError, TypeError, ValueError) as e:
        raise FollowError(f"the leader's GET /adapters is not what a dreamstage leader answers: {e!r}") from None
    ints = [generation, *(x for sv, _, v in live for x in (sv, v))]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ints):
        raise FollowError("the leader's GET /adapters has a served version, version or generation that is not a "
                          "whole number")
    if any(s is not None and not (isinstance(s, str) and _SHA256.fullmatch(s)) for s in shas.values()):
        raise FollowError("the leader's GET /adapters has a sha256 that is not 64 hex digits")
    return live, shas, generation
