"""The job store's SQLite schema, and migrations between its versions.

`PRAGMA user_version` is the schema's version. Opening a store brings an
older one up to `SCHEMA_VERSION` inside one write transaction (so a crash
mid-way leaves it as it was), and refuses a newer one by name rather than
misreading it. Version 0 is every store made before versions were kept.
"""
from __future__ import annotations

import dataclasses
import json
import sqlite3

from pydantic import ValidationError

from dreamstage.training.jobs.request import TrainRequest
from dreamstage.training.jobs.stored import SPEC_VERSION, to_stored

SCHEMA_VERSION = 3

SCHEMA = """
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
    progress TEXT NOT NULL,
    pacing TEXT,
    adapter_name TEXT,
    adapter_version INTEGER,
    spec TEXT,
    spec_version INTEGER
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
    drift TEXT,
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


class SchemaTooNew(RuntimeError):
    """The store was written by a newer dreamstage."""


def migrate(conn: sqlite3.Connection, where: str, now: float) -> int:
    """Bring the schema (already created with `SCHEMA`) to SCHEMA_VERSION,
    inside the caller's write transaction; returns the version it found."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise SchemaTooNew(f"{where} has schema version {found}, written by a newer dreamstage; "
                           f"this one reads up to {SCHEMA_VERSION}")
    if found < 1:
        _to_1(conn, now)
    if found < 2:
        _to_2(conn)
    if found < 3:
        _to_3(conn)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return found


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}


# Progress fields renamed in version 1: each name in the job JSON means one thing.
_PROGRESS_RENAMED = {"window": "window_in_epoch", "chunk": "current_chunk"}


# Columns of versions 0 to 2 that repeated fields of the stored spec.
_SPEC_COPIES = ("context_cache_type", "chunk", "recompute", "exact", "horizon", "window")


def _to_3(conn: sqlite3.Connection) -> None:
    """A job's starting fields live only in its stored spec: the columns that
    repeated them go (a job whose request no longer validated has no spec,
    and reports them as null)."""
    for column in _SPEC_COPIES:
        if column in _columns(conn, "jobs"):
            conn.execute(f"ALTER TABLE jobs DROP COLUMN {column}")


def _to_2(conn: sqlite3.Connection) -> None:
    """Adapters carry the drift figures measured when they were saved (JSON;
    NULL: saved before the drift guard, or with it off)."""
    if "drift" not in _columns(conn, "adapters"):
        conn.execute("ALTER TABLE adapters ADD COLUMN drift TEXT")


def _to_1(conn: sqlite3.Connection, now: float) -> None:
    """Adapters carry a checksum (NULL: not recorded); progress uses the
    version-1 names (`_PROGRESS_RENAMED`); jobs carry the spec they were
    accepted with. A job stored before kept only its request and
    its starting fields, so its spec is derived from the request here, once,
    with the starting fields as they were resolved at its submit."""
    if "sha256" not in _columns(conn, "adapters"):
        conn.execute("ALTER TABLE adapters ADD COLUMN sha256 TEXT")
    jobs = _columns(conn, "jobs")
    for column, kind in (("spec", "TEXT"), ("spec_version", "INTEGER")):
        if column not in jobs:
            conn.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
    for row in conn.execute("SELECT id, progress FROM jobs").fetchall():
        p = json.loads(row["progress"])
        if any(old in p for old in _PROGRESS_RENAMED):
            p = {_PROGRESS_RENAMED.get(k, k): v for k, v in p.items()}
            conn.execute("UPDATE jobs SET progress=? WHERE id=?", (json.dumps(p), row["id"]))
    for row in conn.execute("SELECT * FROM jobs WHERE spec IS NULL").fetchall():
        try:
            spec = TrainRequest.model_validate_json(row["request"]).to_job_spec()
        except ValidationError as e:
            if row["state"] == "queued":           # it could never run: say why instead of failing at start
                conn.execute("UPDATE jobs SET state='error', updated=?, finished=?, message=? WHERE id=?",
                             (now, now, f"its stored request no longer validates: {e.errors()[0]['msg']}", row["id"]))
            continue
        spec = dataclasses.replace(spec, context_cache_type=row["context_cache_type"], chunk=row["chunk"],
                                   min_chunk=min(spec.min_chunk, row["chunk"]), recompute=bool(row["recompute"]),
                                   exact=bool(row["exact"]), horizon=row["horizon"], window=row["window"])
        conn.execute("UPDATE jobs SET spec=?, spec_version=? WHERE id=?", (to_stored(spec), SPEC_VERSION, row["id"]))
