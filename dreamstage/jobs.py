"""Training jobs: the state machine, its SQLite store, the chunk ladder, the walk.

Durability: one SQLite database (WAL, synchronous=FULL) under the state
directory. `JobStore.submit` commits the job (its request and its starting
fields) before it returns, so the server answers 202 only for a job that
survives a crash, power cut included (synchronous=FULL). Receipts and
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
unchanged; the canonical field names are `RECEIPT_FIELDS`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamstage.examples import epoch_order
from dreamstage.trainspec import JobSpec, TrainRequest, check_adapter_name

STATES = ("queued", "starting", "running", "paused", "done", "cancelled", "refused", "error", "interrupted")
ACTIVE = ("starting", "running", "paused")
TERMINAL = frozenset({"done", "cancelled", "refused", "error", "interrupted"})
# Allowed moves. Pause applies to a job that trains; a queued job can only be
# cancelled (or fail to start). Terminal states are final: resubmit instead.
TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"starting", "cancelled", "error"}),
    "starting": frozenset({"running", "refused", "error", "cancelled", "interrupted"}),
    "running": frozenset({"paused", "done", "cancelled", "refused", "error", "interrupted"}),
    "paused": frozenset({"running", "cancelled", "error", "interrupted"}),
    **{s: frozenset() for s in TERMINAL},
}

RECEIPT_FIELDS = (
    "status", "step", "window", "chunk", "chunk_pos", "chunk_tokens", "context_cache_type", "recompute", "exact",
    "horizon", "walk_pass", "loss", "tokens", "ms", "graph_mib", "context_mib", "adapter_mib", "optimizer_mib",
    "walk_mib", "refused_chunk_pos", "refused_chunk_tokens", "refused_need_mib", "refused_allowance_mib", "message",
)
RECEIPT_STATUSES = ("ok", "refused", "error")
MEMORY_FIELDS = ("graph_mib", "context_mib", "adapter_mib", "optimizer_mib", "walk_mib")
STARTING_FIELDS = ("context_cache_type", "chunk", "recompute", "exact", "horizon", "window")
LOSS_EMA_BETA = 0.9  # moving average over finished windows, bias-corrected

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    started REAL,
    finished REAL,
    message TEXT,
    request TEXT NOT NULL,
    out TEXT NOT NULL,
    context_cache_type TEXT NOT NULL,
    chunk INTEGER NOT NULL,
    recompute INTEGER NOT NULL,
    exact INTEGER NOT NULL,
    horizon INTEGER,
    window INTEGER NOT NULL,
    progress TEXT NOT NULL,
    pacing TEXT,
    adapter_name TEXT,
    adapter_version INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, id);
CREATE TABLE IF NOT EXISTS receipts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    seq INTEGER NOT NULL,
    status TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL,
    UNIQUE(job_id, seq)
);
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    path TEXT NOT NULL,
    created REAL NOT NULL,
    job_id INTEGER REFERENCES jobs(id),
    eval_loss REAL,
    sha256 TEXT,
    PRIMARY KEY (name, version)
);
-- One row per promotion; its id is the served version number that every
-- completion reports. Rollback marks the current row rolled back, which makes
-- the previous live row (or the base model, version 0) current again.
CREATE TABLE IF NOT EXISTS promotions (
    served_version INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    at REAL NOT NULL,
    rolled_back_at REAL,
    FOREIGN KEY (name, version) REFERENCES adapters(name, version)
);
"""


class JobError(Exception):
    pass


class JobNotFound(JobError, KeyError):
    def __init__(self, job_id: int):
        self.job_id = job_id
        super().__init__(f"no job {job_id}")

    def __str__(self) -> str:
        return self.args[0]


class InvalidTransition(JobError, ValueError):
    def __init__(self, job_id: int, current: str, target: str):
        self.job_id, self.current, self.target = job_id, current, target
        allowed = ", ".join(sorted(TRANSITIONS.get(current, ()))) or "none, it is final"
        super().__init__(f"job {job_id} cannot go from {current} to {target} (from {current}: {allowed})")


class AdapterNotFound(JobError, KeyError):
    def __str__(self) -> str:
        return self.args[0]


def check_transition(job_id: int, current: str, target: str) -> None:
    if target not in STATES:
        raise ValueError(f"unknown job state {target!r}; states are {', '.join(STATES)}")
    if target not in TRANSITIONS[current]:
        raise InvalidTransition(job_id, current, target)


def receipt_dict(receipt: Any) -> dict[str, Any]:
    """A receipt (dataclass or mapping) as the JSON dict we store, unchanged."""
    is_instance = dataclasses.is_dataclass(receipt) and not isinstance(receipt, type)
    d = dataclasses.asdict(receipt) if is_instance else dict(receipt)
    status = d.get("status")
    if status not in RECEIPT_STATUSES:
        raise ValueError(f"receipt status {status!r} is not one of {', '.join(RECEIPT_STATUSES)}")
    json.dumps(d, allow_nan=True)  # refuse what cannot be stored, here and not mid-transaction
    return d


def _new_progress(spec: JobSpec) -> dict[str, Any]:
    return {
        "step": 0, "window": 0, "windows": None, "windows_done": 0, "epoch": 0, "epochs": spec.epochs,
        # tokens: loss tokens trained; walked: tokens run forward+backward
        # (chunk_tokens); train_tok_s = walked per second of micro-step time.
        "tokens": 0, "walked": 0, "train_ms": 0.0, "train_tok_s": None, "chunk": spec.chunk, "refusals": 0,
        # the exact walk: the horizon in use (0: whole window; None: plain walk)
        # and the last micro-step's pass (forward | backward)
        "horizon": (spec.horizon or 0) if spec.exact else None, "walk_pass": None,
        "loss": None, "loss_avg": None, "train_loss": None, "eval_loss": None,
        "train_loss_per_epoch": [], "eval_loss_per_epoch": [],
        "memory": {k: None for k in MEMORY_FIELDS},
        # accumulators for the epoch in progress and the moving average
        "_win_loss_sum": 0.0, "_win_tokens": 0, "_epoch_loss_sum": 0.0, "_epoch_tokens": 0,
        "_ema": 0.0, "_ema_n": 0,
    }


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class JobStore:
    """Jobs, receipts and adapter versions in `state_dir/dreamstage.sqlite3`."""

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
        self.clock = clock
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(_SCHEMA)
        # Stores made before adapters carried a checksum: add the column (NULL: not recorded).
        if "sha256" not in {r[1] for r in conn.execute("PRAGMA table_info(adapters)")}:
            conn.execute("ALTER TABLE adapters ADD COLUMN sha256 TEXT")
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
    def submit(self, request: TrainRequest) -> dict[str, Any]:
        """Store a validated request as a queued job, committed durably."""
        spec = request.to_job_spec()
        now = self.clock()
        body = request.model_dump_json(exclude_none=True)
        with self._write() as c:
            cur = c.execute(
                "INSERT INTO jobs (state, created, updated, request, out, context_cache_type, chunk, recompute,"
                " exact, horizon, window, progress) VALUES ('queued', ?, ?, ?, '', ?, ?, ?, ?, ?, ?, ?)",
                (now, now, body, spec.context_cache_type, spec.chunk, int(spec.recompute), int(spec.exact),
                 spec.horizon, spec.window, json.dumps(_new_progress(spec))),
            )
            job_id = cur.lastrowid
            assert job_id is not None  # set by the INSERT
            c.execute("UPDATE jobs SET out=? WHERE id=?", (spec.out or f"job-{job_id}", job_id))
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
        """The job's spec, re-derived from the stored request."""
        return self.request(job_id).to_job_spec()

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
        """Queued job ids, oldest first (the order they will train in)."""
        return [r["id"] for r in self._conn().execute("SELECT id FROM jobs WHERE state='queued' ORDER BY id")]

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
            _fold_receipt(p, d)
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
        """Set plain progress fields (e.g. window=, windows=, epoch=)."""
        bad = [k for k in fields if k.startswith("_") or k in ("memory",)]
        if bad:
            raise ValueError(f"progress fields {bad} are not set directly")
        self._edit_progress(job_id, lambda p: p.update(fields))

    def end_window(self, job_id: int) -> float | None:
        """Close the window the last ok receipts belong to. Its loss is the
        token-weighted mean of their chunk losses (a receipt's `loss` is the
        mean CE over that chunk's `tokens` loss tokens); it feeds the moving
        average and the epoch's train loss. Returns it (None: no loss tokens)."""
        out: list[float | None] = [None]

        def fold(p: dict[str, Any]) -> None:
            tokens, loss_sum = p["_win_tokens"], p["_win_loss_sum"]
            p["_win_tokens"], p["_win_loss_sum"] = 0, 0.0
            p["windows_done"] += 1
            if not tokens:
                return
            loss = loss_sum / tokens
            p["_epoch_loss_sum"] += loss_sum
            p["_epoch_tokens"] += tokens
            p["_ema"] = LOSS_EMA_BETA * p["_ema"] + (1 - LOSS_EMA_BETA) * loss
            p["_ema_n"] += 1
            p["loss"] = out[0] = loss
            p["loss_avg"] = p["_ema"] / (1 - LOSS_EMA_BETA ** p["_ema_n"])

        self._edit_progress(job_id, fold)
        return out[0]

    def end_epoch(self, job_id: int, eval_loss: float | None = None) -> dict[str, Any]:
        """Close the epoch: its token-weighted train loss and held-out loss
        (None when nothing is held out). Returns the progress."""

        def fold(p: dict[str, Any]) -> None:
            train = p["_epoch_loss_sum"] / p["_epoch_tokens"] if p["_epoch_tokens"] else None
            p["train_loss_per_epoch"].append(train)
            p["eval_loss_per_epoch"].append(eval_loss)
            p["train_loss"], p["eval_loss"] = train, eval_loss
            p["_epoch_loss_sum"], p["_epoch_tokens"] = 0.0, 0
            p["epoch"] = len(p["train_loss_per_epoch"])

        return self._edit_progress(job_id, fold)

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
        return _public(p)

    # -- views -------------------------------------------------------------------
    def get(self, job_id: int) -> dict[str, Any]:
        """One job as GET /train/{id} reports it."""
        with self._read() as conn:
            return self._view(job_id, conn)

    def _view(self, job_id: int, conn: sqlite3.Connection) -> dict[str, Any]:
        row = self._row(job_id, conn)
        p = json.loads(row["progress"])
        request = json.loads(row["request"])
        n_examples = (1 if "text" in request else 0) + len(request.pop("examples", []))
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
            **{k: row[k] for k in STARTING_FIELDS},
            "recompute": bool(row["recompute"]),
            "exact": bool(row["exact"]),
            "spec": {**request, "examples": n_examples},
            "progress": _public(p),
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

    # -- adapters -----------------------------------------------------------------
    def adapter_path(self, name: str, version: int) -> Path:
        """Where version `version` of adapter `name` lives: always inside
        state_dir/adapters/ (names are bare; checked again here)."""
        check_adapter_name(name)
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"adapter version must be a positive integer, got {version!r}")
        path = (self.adapters_dir / name / f"v{version}.gguf").resolve()
        if self.adapters_dir.resolve() not in path.parents:
            raise ValueError(f"adapter {name!r} would leave the state directory")
        return path

    def next_adapter_version(self, name: str) -> int:
        check_adapter_name(name)
        row = self._conn().execute("SELECT COALESCE(MAX(version), 0) + 1 FROM adapters WHERE name=?",
                                   (name,)).fetchone()
        return row[0]

    def add_adapter(self, name: str, version: int, job_id: int | None = None,
                    eval_loss: float | None = None) -> dict[str, Any]:
        """Record a saved adapter file (written atomically by the engine at
        `adapter_path(name, version)`), and attach it to its job."""
        path = self.adapter_path(name, version)
        # The checksum of the bytes as saved: a reload (or an operator) can tell
        # whether the file is still the one that was trained and promoted.
        digest = file_sha256(path) if path.exists() else None
        with self._write() as c:
            if job_id is not None:
                self._row(job_id, c)
            c.execute("INSERT INTO adapters (name, version, path, created, job_id, eval_loss, sha256) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (name, version, str(path), self.clock(), job_id, eval_loss, digest))
            if job_id is not None:
                c.execute("UPDATE jobs SET adapter_name=?, adapter_version=? WHERE id=?", (name, version, job_id))
        return self._adapter_view(name, version)

    def _served_row(self, conn: sqlite3.Connection) -> sqlite3.Row | None:
        return conn.execute("SELECT * FROM promotions WHERE rolled_back_at IS NULL "
                            "ORDER BY served_version DESC LIMIT 1").fetchone()

    def _adapter_view(self, name: str, version: int, conn: sqlite3.Connection | None = None) -> dict[str, Any]:
        conn = conn or self._conn()
        row = conn.execute("SELECT * FROM adapters WHERE name=? AND version=?", (name, version)).fetchone()
        if row is None:
            raise AdapterNotFound(f"no adapter {name!r} version {version}")
        served = self._served_row(conn)
        promoted = served is not None and (served["name"], served["version"]) == (name, version)
        return {"name": name, "version": version, "path": row["path"], "created": row["created"],
                "job_id": row["job_id"], "eval_loss": row["eval_loss"], "sha256": row["sha256"], "promoted": promoted,
                "served_version": served["served_version"] if promoted and served is not None else None}

    def adapters(self) -> list[dict[str, Any]]:
        conn = self._conn()
        rows = conn.execute("SELECT name, version FROM adapters ORDER BY name, version").fetchall()
        return [self._adapter_view(r["name"], r["version"], conn) for r in rows]

    def served(self) -> dict[str, Any] | None:
        """The adapter being served now (for reload at startup), or None for the base model."""
        conn = self._conn()
        row = self._served_row(conn)
        return self._adapter_view(row["name"], row["version"], conn) if row else None

    def served_version(self) -> int:
        """The number every completion reports; 0 is the base model."""
        row = self._served_row(self._conn())
        return row["served_version"] if row else 0

    def promotions(self) -> list[dict[str, Any]]:
        """The live promotion stack, oldest first (what rollback walks back through)."""
        return [dict(r) for r in self._conn().execute(
            "SELECT served_version, name, version, at FROM promotions WHERE rolled_back_at IS NULL "
            "ORDER BY served_version")]

    def promote(self, name: str, version: int | None = None) -> dict[str, Any]:
        """Book a promotion (latest version by default) under a new served
        version. The engine swaps the weights between decode batches."""
        check_adapter_name(name)
        with self._write() as c:
            if version is None:
                row = c.execute("SELECT MAX(version) FROM adapters WHERE name=?", (name,)).fetchone()
                version = row[0]
                if version is None:
                    raise AdapterNotFound(f"no adapter {name!r}")
            elif c.execute("SELECT 1 FROM adapters WHERE name=? AND version=?", (name, version)).fetchone() is None:
                raise AdapterNotFound(f"no adapter {name!r} version {version}")
            c.execute("INSERT INTO promotions (name, version, at) VALUES (?, ?, ?)", (name, version, self.clock()))
        return self._adapter_view(name, version)

    def rollback(self) -> dict[str, Any] | None:
        """Undo the current promotion; returns what is served now (None = base)."""
        with self._write() as c:
            row = self._served_row(c)
            if row is None:
                raise AdapterNotFound("nothing to roll back: the base model is served")
            c.execute("UPDATE promotions SET rolled_back_at=? WHERE served_version=?",
                      (self.clock(), row["served_version"]))
        return self.served()


def _fold_receipt(p: dict[str, Any], d: Mapping[str, Any]) -> None:
    if d["status"] == "ok":
        p["step"] += 1
        tokens = int(d.get("tokens") or 0)
        p["tokens"] += tokens
        p["walked"] += int(d.get("chunk_tokens") or 0)
        p["train_ms"] += float(d.get("ms") or 0.0)
        if p["train_ms"] > 0:
            p["train_tok_s"] = p["walked"] / (p["train_ms"] / 1000.0)
        loss = d.get("loss")
        if tokens and loss is not None and math.isfinite(loss):
            p["_win_loss_sum"] += float(loss) * tokens
            p["_win_tokens"] += tokens
        for k in MEMORY_FIELDS:
            if d.get(k) is not None:
                p["memory"][k] = d[k]
        if d.get("walk_pass"):
            p["walk_pass"] = d["walk_pass"]
    elif d["status"] == "refused":
        p["refusals"] += 1
    if d.get("exact") and d.get("horizon") is not None:
        p["horizon"] = d["horizon"]      # in use (0: the whole window); a halving refusal names the new one
    if d.get("chunk") is not None:
        p["chunk"] = d["chunk"]


def _public(p: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in p.items() if not k.startswith("_") and k != "memory"}


def auto_promote_decision(eval_before: float | None, eval_after: float | None) -> tuple[bool, str]:
    """promote="auto": promote when held-out loss is no worse than before
    training. With nothing held out there is no evidence either way; we promote
    (the user asked for auto) and say so."""
    if eval_after is None or eval_before is None:
        return True, "nothing held out; promoted on completion"
    if eval_after <= eval_before:
        return True, f"held-out loss {eval_after:.4f} is no worse than {eval_before:.4f}"
    return False, f"held-out loss {eval_after:.4f} is worse than {eval_before:.4f}; not promoted"


# -- the chunk ladder ------------------------------------------------------------
def next_chunk(chunk: int, floor: int) -> int | None:
    """After a refusal at `chunk`: halve, never below `floor` (the floor itself
    is tried); None when `chunk` already is at or below the floor."""
    if chunk < 1 or floor < 1:
        raise ValueError(f"chunk {chunk} and floor {floor} must be >= 1")
    return None if chunk <= floor else max(chunk // 2, floor)


def chunk_after_refusal(receipt: Mapping[str, Any], floor: int) -> int | None:
    """The chunk to retry with after a refused receipt, or None: the job ends refused."""
    if receipt.get("status") != "refused":
        raise ValueError(f"chunk_after_refusal needs a refused receipt, got status {receipt.get('status')!r}")
    chunk = receipt.get("chunk") or receipt.get("refused_chunk_tokens")
    if not chunk:
        raise ValueError("a refused receipt names neither chunk nor refused_chunk_tokens")
    return next_chunk(int(chunk), floor)


def ladder(chunk: int, floor: int) -> list[int]:
    """Every chunk the ladder would try, from `chunk` down."""
    rungs = [chunk]
    while (nxt := next_chunk(rungs[-1], floor)) is not None:
        rungs.append(nxt)
    return rungs


# -- the walk: which micro-step comes next -----------------------------------------
@dataclass(frozen=True)
class MicroStep:
    epoch: int
    window_index: int      # index into the job's train windows
    order_pos: int         # how many windows of this epoch came before
    chunk_pos: int
    chunk_tokens: int
    chunk: int             # the ladder's current chunk size
    last_in_window: bool   # the optimizer update follows this chunk


@dataclass
class Walk:
    """The job's position: epochs x windows (seeded order) x chunks, and the
    chunk ladder. Pure; the engine asks `current()`, runs that micro-step, and
    reports its receipt to `advance()`, which says what happened:

    "step" (next chunk of the same window), "window" (a window finished),
    "epoch" (an epoch finished), "done", "retry" (refused; chunk halved, same
    position), "refused" (refused at the floor), "error".
    A refusal allocated nothing and changed nothing (issue 4), so the walk
    retries at the same chunk_pos with the smaller chunk.

    The exact walk (exact=True) runs a window as a forward sweep and a reverse
    pass whose chunks the native core chooses, so its positions are not
    predicted here: each step is the window's next micro-step (chunk_pos 0,
    chunk_tokens 0 in `current()`), and the engine says when the trainer has
    no chunks left (`advance(..., window_done=)`). A refusal that halved the
    horizon (the receipt's horizon differs from the one in use) retries with
    the same chunk; any other refusal goes down the chunk ladder.
    """

    window_lengths: list[int]
    epochs: int
    seed: int
    chunk: int
    floor: int
    epoch: int = 0
    order_pos: int = 0
    chunk_pos: int = 0
    exact: bool = False
    horizon: int = 0       # exact walk: the horizon in use (0: the whole window), as the receipts report it
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if not self.window_lengths:
            raise ValueError("a walk needs at least one window")
        self._order = epoch_order(len(self.window_lengths), self.epoch, self.seed)

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    def current(self) -> MicroStep | None:
        if self.finished:
            return None
        w = self._order[self.order_pos]
        if self.exact:
            return MicroStep(self.epoch, w, self.order_pos, 0, 0, self.chunk, False)
        n = self.window_lengths[w]
        k = min(self.chunk, n - self.chunk_pos)
        return MicroStep(self.epoch, w, self.order_pos, self.chunk_pos, k, self.chunk, self.chunk_pos + k >= n)

    def advance(self, receipt: Mapping[str, Any], window_done: bool | None = None) -> str:
        step = self.current()
        if step is None:
            raise ValueError("the walk is finished")
        status = receipt.get("status")
        horizon = receipt.get("horizon")
        if self.exact and status in ("ok", "refused") and horizon is not None and horizon != self.horizon:
            self.horizon = horizon
            if status == "refused":
                return "retry"          # the native core halved the horizon; the chunk stays
        if status == "refused":
            nxt = next_chunk(self.chunk, self.floor)
            if nxt is None:
                return "refused"
            self.chunk = nxt
            return "retry"
        if status != "ok":
            return "error"
        if self.exact:
            if window_done is None:
                raise ValueError("the exact walk's windows end when the trainer says so: pass window_done")
            return self._next_window() if window_done else "step"
        got = (receipt.get("chunk_pos"), receipt.get("chunk_tokens"))
        if None not in got and got != (step.chunk_pos, step.chunk_tokens):
            raise ValueError(f"the trainer ran chunk_pos {got[0]} x {got[1]} tokens but the walk expected "
                             f"{step.chunk_pos} x {step.chunk_tokens}: the trainer's chunk is out of step")
        self.chunk_pos += step.chunk_tokens
        if not step.last_in_window:
            return "step"
        return self._next_window()

    def _next_window(self) -> str:
        self.chunk_pos = 0
        self.order_pos += 1
        if self.order_pos < len(self._order):
            return "window"
        self.order_pos = 0
        self.epoch += 1
        if self.finished:
            return "done"
        self._order = epoch_order(len(self.window_lengths), self.epoch, self.seed)
        return "epoch"



class JobRun:
    """The bookkeeping of the job being trained: its walk and its store rows.

    The engine owns the Trainer and the llama calls; this owns everything
    else. Per micro-step: `current()` says which window and chunk; when
    `chunk_pos == 0` the engine begins that window on the trainer; it runs one
    micro-step and hands the receipt to `record()`, which stores it, moves the
    walk, closes finished windows, and ends the job `refused` (ladder at its
    floor) or `error`. The returned event is Walk.advance's; on "retry" the
    engine sets the trainer's chunk to `run.chunk`; on "epoch" and "done" it
    evaluates the held-out windows and calls `end_epoch`.
    """

    def __init__(self, store: JobStore, job_id: int, spec: JobSpec, windows: Sequence[Any]):
        self.store, self.job_id, self.windows = store, job_id, windows
        self.walk = Walk([len(w) for w in windows], spec.epochs, spec.seed, spec.chunk, spec.min_chunk,
                         exact=spec.exact, horizon=spec.horizon or 0)
        store.update_progress(job_id, windows=len(windows), window=0, epoch=0)

    @property
    def chunk(self) -> int:
        return self.walk.chunk

    def current(self) -> tuple[Any, MicroStep] | None:
        step = self.walk.current()
        return None if step is None else (self.windows[step.window_index], step)

    def should_step(self) -> bool:
        """Whether the job is running (not paused, cancelled or ended) and has work left."""
        return not self.walk.finished and self.store.state(self.job_id) == "running"

    def ended(self) -> bool:
        """Whether the job reached a final state (cancelled by the server,
        refused, ...): the engine then frees its Trainer and picks the next job."""
        return self.store.state(self.job_id) in TERMINAL

    def record(self, receipt: Any, window_done: bool | None = None) -> str:
        """window_done: the trainer has no chunks left (the exact walk's window end)."""
        d = receipt_dict(receipt)
        self.store.append_receipt(self.job_id, d)
        event = self.walk.advance(d, window_done)
        if event in ("window", "epoch", "done"):
            self.store.end_window(self.job_id)
            self.store.update_progress(self.job_id, window=self.walk.order_pos)
        elif event == "refused":
            self.store.transition(self.job_id, "refused", message=(
                f"chunk {self.walk.chunk} was refused at the ladder's floor ({self.walk.floor}): "
                f"{d.get('message') or 'no message'}"))
        elif event == "error":
            self.store.transition(self.job_id, "error", message=d.get("message") or "the micro-step failed")
        return event

    def end_epoch(self, eval_loss: float | None) -> dict[str, Any]:
        return self.store.end_epoch(self.job_id, eval_loss)
