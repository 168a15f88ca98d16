"""Training jobs: the state machine and its SQLite store (jobs, receipts, adapter versions).

Durability: one SQLite database (WAL, synchronous=FULL) under the state
directory. `JobStore.submit` commits the job (its request and its spec as
stored JSON, `stored.to_stored`) before it returns, so the server answers 202
only for a job that survives a crash, power cut included (synchronous=FULL).
A job's starting fields live only inside that stored spec (schema version 3
dropped the columns that repeated them); `starting_fields` reads them back. Receipts and
progress commit per micro-step with synchronous=NORMAL: safe against a
process crash at once, and against a power cut from the next state change
(see `_write`).
On open, jobs left starting/running/paused become `interrupted` (their
in-memory adapter and optimizer are gone); queued jobs stay queued, FIFO.

Threads: the engine thread writes, the server thread reads. Each thread gets
its own connection; writes also take one lock and BEGIN IMMEDIATE, so a state
change is a compare-and-set: a cancel from the server and a `done` from the
engine cannot both win.

Receipts are stored as the JSON dicts the native Receipt dataclass produces,
unchanged; the canonical field names are `receipts.RECEIPT_FIELDS`. What a
receipt does to the progress is `progress.py`; where the job is in its
windows is `dreamstage/training/walk/plan.py`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dreamstage import environment
from dreamstage.adapters.versions import AdapterVersions
from dreamstage.training.jobs.errors import JobError, JobNotFound
from dreamstage.training.jobs.progress import (
    close_epoch,
    close_window,
    fold_receipt,
    new_progress,
    public_progress,
    restart_window,
)
from dreamstage.training.jobs.request import TrainRequest
from dreamstage.training.jobs.schema import SCHEMA, SchemaTooNew, migrate
from dreamstage.training.jobs.spec import JobSpec
from dreamstage.training.jobs.stored import SPEC_VERSION, from_stored, to_stored
from dreamstage.training.walk.receipts import receipt_dict

STATES = ("queued", "starting", "running", "paused", "held", "done", "cancelled", "refused", "error", "interrupted")
ACTIVE = ("starting", "running", "paused", "held")
TERMINAL = frozenset({"done", "cancelled", "refused", "error", "interrupted"})
# Allowed moves. Pause applies to a job that trains; a queued job can only be
# cancelled (or fail to start). Terminal states are final: resubmit instead.
TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"starting", "cancelled", "error"}),
    "starting": frozenset({"running", "refused", "error", "cancelled", "interrupted"}),
    "running": frozenset({"paused", "held", "done", "cancelled", "refused", "error", "interrupted"}),
    "paused": frozenset({"running", "cancelled", "error", "interrupted"}),
    # held: an RPC worker under the job failed; the engine alone moves it on (ENGINE_ONLY)
    "held": frozenset({"running", "cancelled", "error", "interrupted"}),
    **{s: frozenset() for s in TERMINAL},
}

# Moves only the engine makes: a held job runs again once its worker is back (POST resume is refused).
ENGINE_ONLY = frozenset({("held", "running")})

STARTING_FIELDS = ("context_cache_type", "chunk", "recompute", "exact", "horizon", "window")


def starting_fields(stored_spec: str | None) -> dict[str, Any]:
    """The fields a job starts with, as GET /train/{id} shows them, read from
    its stored spec (all null for a job stored without one)."""
    spec = json.loads(stored_spec) if stored_spec is not None else {}
    return {k: spec.get(k) for k in STARTING_FIELDS}


def default_state_dir() -> Path:
    """$XDG_DATA_HOME/dreamstage, else ~/.local/share/dreamstage."""
    return environment.data_dir()


class InvalidTransition(JobError, ValueError):
    def __init__(self, job_id: int, current: str, target: str, why: str | None = None):
        self.job_id, self.current, self.target = job_id, current, target
        allowed = ", ".join(sorted(TRANSITIONS.get(current, ()))) or "none, it is final"
        super().__init__(f"job {job_id} cannot go from {current} to {target} ({why or f'from {current}: {allowed}'})")


def check_transition(job_id: int, current: str, target: str) -> None:
    if target not in STATES:
        raise ValueError(f"unknown job state {target!r}; states are {', '.join(STATES)}")
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(job_id, current, target)



class JobStore(AdapterVersions):
    """Jobs, receipts and adapter versions in `state_dir/dreamstage.sqlite3`
    (the versions and their promotions: `AdapterVersions`)."""

    DB_NAME = "dreamstage.sqlite3"

    def __init__(self, state_dir: str | Path, clock: Callable[[], float] = time.time):
        self.state_dir = Path(state_dir)
        # The database holds every training example: owner-only, like the
        # adapters. SQLite gives its -wal and -shm files the database's mode.
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.adapters_dir = self.state_dir / "adapters"
        self.path = self.state_dir / self.DB_NAME
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        for p in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            if p.exists() and p.stat().st_mode & 0o077:
                p.chmod(0o600)     # made by an older version with the umask's mode
        if self.adapters_dir.is_dir():     # adapter directories are owner-only too (older versions: the umask's)
            for d in (self.adapters_dir, *(c for c in self.adapters_dir.iterdir() if c.is_dir())):
                if d.stat().st_mode & 0o077:
                    d.chmod(0o700)
        self.clock = clock
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(SCHEMA)
        try:
            with self._write() as c:
                self.schema_found = migrate(c, str(self.path), self.clock())
        except SchemaTooNew as e:
            self.close()
            raise JobError(str(e)) from None
        self.recovered = self._recover()

    # -- connections --------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise JobError("the job store is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # check_same_thread=False only so close() can close every thread's
            # connection at shutdown; each connection is used by its own thread.
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    class _Txn:
        def __init__(self, store: JobStore, durable: bool):
            self.store, self.durable = store, durable

        def __enter__(self) -> sqlite3.Connection:
            self.store._write_lock.acquire()
            try:
                self.conn = self.store._conn()
                self.conn.execute(f"PRAGMA synchronous={'FULL' if self.durable else 'NORMAL'}")
                self.conn.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.store._write_lock.release()
                raise
            return self.conn

        def __exit__(self, exc_type, exc, tb):
            try:
                self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
            finally:
                self.store._write_lock.release()
            return False

    def _write(self, durable: bool = True) -> JobStore._Txn:
        """A write transaction. durable=True (FULL) fsyncs the WAL at commit:
        used for what the API promises (accepted jobs, state changes, adapter
        versions). durable=False (NORMAL) survives a process crash but may lose
        its last commits to a power cut; receipts and progress use it, because
        an fsync per micro-step measured ~4 ms on the project disk, and the
        next durable commit (any state change) syncs them too: the WAL is one
        sequential log."""
        return JobStore._Txn(self, durable)

    def transaction(self, durable: bool = True) -> JobStore._Txn:
        """A write transaction for tables kept beside the jobs (records and feedback, dreamstage/records/)."""
        return self._write(durable)

    def reading(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """A read transaction (one snapshot) for tables kept beside the jobs."""
        return self._read()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction (a WAL snapshot), so a view assembled from
        several queries is consistent. Re-entrant within a thread."""
        conn = self._conn()
        depth = getattr(self._local, "read_depth", 0)
        if depth == 0 and not conn.in_transaction:
            conn.execute("BEGIN")
        self._local.read_depth = depth + 1
        try:
            yield conn
        finally:
            self._local.read_depth = depth
            if depth == 0 and conn.in_transaction:
                conn.execute("COMMIT")

    def close(self) -> None:
        with self._conns_lock:
            for c in self._conns:
                c.close()
            self._conns.clear()
        self._closed = True

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _recover(self) -> list[int]:
        now = self.clock()
        with self._write() as c:
            rows = c.execute(f"SELECT id, state FROM jobs WHERE state IN ({','.join('?' * len(ACTIVE))}) ORDER BY id",
                             ACTIVE).fetchall()
            for row in rows:
                c.execute("UPDATE jobs SET state='interrupted', updated=?, finished=?, message=? WHERE id=?",
                          (now, now, f"the server stopped while the job was {row['state']}; "
                                     "its in-memory adapter and optimizer state were lost", row["id"]))
        return [r["id"] for r in rows]

    # -- jobs ----------------------------------------------------------------
    def submit(self, request: TrainRequest, spec: JobSpec | None = None,
               within: Callable[[sqlite3.Connection, int], None] | None = None) -> dict[str, Any]:
        """Store a validated request as a queued job, committed durably, with
        its spec (`request.to_job_spec()` unless given) as the job will run.
        `within(conn, job_id)` runs inside the same transaction (what the job claims; raising stores nothing)."""
        spec = spec if spec is not None else request.to_job_spec()
        now = self.clock()
        # the request as shown in GET /train/{id}: unset optional fields left
        # out, but a null the client sent kept (stop_loss null: every epoch)
        shown = request.model_dump(mode="json", exclude_none=True)
        shown.update({k: None for k in request.model_fields_set if getattr(request, k) is None})
        body = json.dumps(shown)
        with self._write() as c:
            cur = c.execute(
                "INSERT INTO jobs (state, created, updated, request, out, progress, spec, spec_version)"
                " VALUES ('queued', ?, ?, ?, '', ?, ?, ?)",
                (now, now, body, json.dumps(new_progress(spec)), to_stored(spec), SPEC_VERSION),
            )
            job_id = cur.lastrowid
            assert job_id is not None  # set by the INSERT
            c.execute("UPDATE jobs SET out=? WHERE id=?", (spec.out or f"job-{job_id}", job_id))
            if within is not None:
                within(c, job_id)
        return self.get(job_id)

    def _row(self, job_id: int, conn: sqlite3.Connection | None = None) -> sqlite3.Row:
        row = (conn or self._conn()).execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return row

    def state(self, job_id: int) -> str:
        return self._row(job_id)["state"]

    def request(self, job_id: int) -> TrainRequest:
        return TrainRequest.model_validate_json(self._row(job_id)["request"])

    def spec(self, job_id: int) -> JobSpec:
        """The job's spec as it was derived at submit (never re-derived: a
        changed default does not change a job already accepted)."""
        row = self._row(job_id)
        if row["spec"] is None:
            raise JobError(f"job {job_id} has no stored spec (its request no longer validated when the store "
                           "was upgraded)")
        try:
            return from_stored(row["spec"], row["spec_version"])
        except ValueError as e:
            raise JobError(f"job {job_id}: {e}") from None

    def transition(self, job_id: int, target: str, message: str | None = None) -> str:
        """Move a job to `target` if the table allows it; returns the prior state."""
        now = self.clock()
        with self._write() as c:
            current = self._row(job_id, c)["state"]
            check_transition(job_id, current, target)
            sets, args = ["state=?", "updated=?"], [target, now]
            if target == "starting":
                sets.append("started=?")
                args.append(now)
            if target in TERMINAL:
                sets.append("finished=?")
                args.append(now)
            if message is not None:
                sets.append("message=?")
                args.append(message)
            c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id=?", (*args, job_id))
        return current

    def queue(self) -> list[int]:
        """Queued job ids in the order they will train in: round-robin across
        adapter names (`out`), the name that last started a job longest ago
        first (a name that never did, before any that did), each name's jobs
        oldest first. So a long queue for one adapter does not starve a short
        job for another."""
        with self._read() as conn:
            rows = conn.execute("SELECT id, out FROM jobs WHERE state='queued' ORDER BY id").fetchall()
            started = {r["out"]: r["at"] for r in conn.execute(
                "SELECT out, MAX(started) AS at FROM jobs WHERE started IS NOT NULL GROUP BY out")}
        per_name: dict[str, list[int]] = {}
        for r in rows:
            per_name.setdefault(r["out"], []).append(r["id"])
        names = sorted(per_name, key=lambda n: (n in started, started.get(n, 0.0), per_name[n][0]))
        order: list[int] = []
        while names:
            for n in names:
                order.append(per_name[n].pop(0))
            names = [n for n in names if per_name[n]]
        return order

    def next_queued(self) -> int | None:
        q = self.queue()
        return q[0] if q else None

    def current_id(self) -> int | None:
        row = self._conn().execute(
            f"SELECT id FROM jobs WHERE state IN ({','.join('?' * len(ACTIVE))}) ORDER BY id LIMIT 1", ACTIVE
        ).fetchone()
        return row["id"] if row else None

    def job_ids(self, limit: int = 100) -> list[int]:
        return [r["id"] for r in self._conn().execute("SELECT id FROM jobs ORDER BY id DESC LIMIT ?", (limit,))]

    # -- receipts and progress -------------------------------------------------
    def append_receipt(self, job_id: int, receipt: Any) -> int:
        """Append one receipt (committed) and fold it into the progress; returns its seq."""
        d = receipt_dict(receipt)
        now = self.clock()
        with self._write(durable=False) as c:
            row = self._row(job_id, c)
            seq = c.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM receipts WHERE job_id=?", (job_id,)).fetchone()[0]
            c.execute("INSERT INTO receipts (job_id, seq, status, at, body) VALUES (?, ?, ?, ?, ?)",
                      (job_id, seq, d["status"], now, json.dumps(d)))
            p = json.loads(row["progress"])
            fold_receipt(p, d)
            c.execute("UPDATE jobs SET progress=?, updated=? WHERE id=?", (json.dumps(p), now, job_id))
        return seq

    def receipts(self, job_id: int, status: str | None = None, after_seq: int = 0) -> list[dict[str, Any]]:
        self._row(job_id)
        q = "SELECT seq, body FROM receipts WHERE job_id=? AND seq>?"
        args: list[Any] = [job_id, after_seq]
        if status is not None:
            q += " AND status=?"
            args.append(status)
        return [json.loads(r["body"]) for r in self._conn().execute(q + " ORDER BY seq", args)]

    def refusals(self, job_id: int) -> list[dict[str, Any]]:
        return self.receipts(job_id, status="refused")

    def update_progress(self, job_id: int, **fields: Any) -> None:
        """Set plain progress fields (e.g. window_in_epoch=, windows=, epoch=)."""
        bad = [k for k in fields if k.startswith("_") or k in ("memory",)]
        if bad:
            raise ValueError(f"progress fields {bad} are not set directly")

        def edit(p: dict[str, Any]) -> None:
            # a misspelt (or renamed) field would otherwise be stored beside the real one
            unknown = sorted(set(fields) - set(p))
            if unknown:
                raise ValueError(f"unknown progress fields {unknown}")
            p.update(fields)

        self._edit_progress(job_id, edit)

    def end_window(self, job_id: int) -> float | None:
        """Close the window the last ok receipts belong to (`progress.close_window`); returns its loss."""
        out: list[float | None] = [None]

        def fold(p: dict[str, Any]) -> None:
            out[0] = close_window(p)

        self._edit_progress(job_id, fold)
        return out[0]

    def restart_window(self, job_id: int) -> None:
        """The window in progress starts again (`progress.restart_window`): a held job resumed."""
        self._edit_progress(job_id, restart_window)

    def end_epoch(self, job_id: int, eval_loss: float | None = None,
                  examples_loss: float | None = None) -> dict[str, Any]:
        """Close the epoch (`progress.close_epoch`). Returns the progress."""
        return self._edit_progress(job_id, lambda p: close_epoch(p, eval_loss, examples_loss))

    def set_pacing(self, job_id: int, figures: Mapping[str, Any]) -> None:
        with self._write(durable=False) as c:
            self._row(job_id, c)
            c.execute("UPDATE jobs SET pacing=?, updated=? WHERE id=?",
                      (json.dumps(dict(figures)), self.clock(), job_id))

    def _edit_progress(self, job_id: int, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        with self._write(durable=False) as c:
            p = json.loads(self._row(job_id, c)["progress"])
            edit(p)
            c.execute("UPDATE jobs SET progress=?, updated=? WHERE id=?", (json.dumps(p), self.clock(), job_id))
        return public_progress(p)

    # -- views -------------------------------------------------------------------
    def get(self, job_id: int) -> dict[str, Any]:
        """One job as GET /train/{id} reports it."""
        with self._read() as conn:
            return self._view(job_id, conn)

    def _view(self, job_id: int, conn: sqlite3.Connection) -> dict[str, Any]:
        row = self._row(job_id, conn)
        p = json.loads(row["progress"])
        request = json.loads(row["request"])
        # a body may give "examples": null beside its text (or "text": null beside examples)
        n_examples = (request.get("text") is not None) + len(request.pop("examples", None) or [])
        request.pop("text", None)
        adapter = None
        if row["adapter_name"] is not None:
            adapter = self._adapter_view(row["adapter_name"], row["adapter_version"], conn)
        return {
            "id": row["id"],
            "state": row["state"],
            "created": row["created"],
            "updated": row["updated"],
            "started": row["started"],
            "finished": row["finished"],
            "message": row["message"],
            "out": row["out"],
            **starting_fields(row["spec"]),
            "spec": {**request, "examples": n_examples},
            "progress": public_progress(p),
            "memory": p["memory"],
            "pacing": json.loads(row["pacing"]) if row["pacing"] else None,
            "adapter": adapter,
            "refusals": self.refusals(job_id),
            "receipts": conn.execute("SELECT COUNT(*) FROM receipts WHERE job_id=?", (job_id,)).fetchone()[0],
        }

    def overview(self) -> dict[str, Any]:
        """GET /train: the current job (starting/running/paused) and the queue."""
        with self._read():
            cur = self.current_id()
            return {"current": self.get(cur) if cur is not None else None,
                    "queue": [self.get(j) for j in self.queue()]}
