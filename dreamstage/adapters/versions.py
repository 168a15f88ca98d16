"""Adapter versions and their promotions: the store's `adapters` and `promotions` tables.

`JobStore` (training/jobs/store.py) inherits these methods; they use its
connections and transactions (`_conn`, `_read`, `_write`, and the public
`reading` and `transaction` that replicas.py uses), its `adapters_dir` and its
`clock`. What serves adapters (served.py, replicas.py) needs only this class. A version's
file lives at `adapter_path(name, version)`; a promotion books a version
under a new served version number, and a rollback marks the latest one.
"""
from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dreamstage.adapters.files import file_sha256
from dreamstage.adapters.names import check_adapter_name


class AdapterNotFound(KeyError):
    """No such adapter name or version (or nothing to roll back)."""

    def __str__(self) -> str:
        return self.args[0]


class AdapterVersions:
    # JobStore's, which these methods use: the adapters' folder, the clock, a thread's connection,
    # a read snapshot, a write transaction and a job's row (JobNotFound when there is none)
    adapters_dir: Path
    clock: Callable[[], float]
    _conn: Callable[[], sqlite3.Connection]
    _read: Callable[[], contextlib.AbstractContextManager[sqlite3.Connection]]
    _write: Callable[..., contextlib.AbstractContextManager[sqlite3.Connection]]
    _row: Callable[..., sqlite3.Row]
    reading: Callable[[], contextlib.AbstractContextManager[sqlite3.Connection]]
    transaction: Callable[..., contextlib.AbstractContextManager[sqlite3.Connection]]

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
                    eval_loss: float | None = None, drift: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Record a saved adapter file (written atomically by the engine at
        `adapter_path(name, version)`), and attach it to its job."""
        path = self.adapter_path(name, version)
        # The checksum of the bytes as saved: a reload (or an operator) can tell
        # whether the file is still the one that was trained and promoted.
        digest = file_sha256(path) if path.exists() else None
        with self._write() as c:
            if job_id is not None:
                self._row(job_id, c)
            c.execute("INSERT INTO adapters (name, version, path, created, job_id, eval_loss, sha256, drift) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (name, version, str(path), self.clock(), job_id, eval_loss, digest,
                       json.dumps(dict(drift)) if drift is not None else None))
            if job_id is not None:
                c.execute("UPDATE jobs SET adapter_name=?, adapter_version=? WHERE id=?", (name, version, job_id))
        return self._adapter_view(name, version)

    def _served_row(self, conn: sqlite3.Connection, name: str | None = None) -> sqlite3.Row | None:
        """The live promotion serving `name` (its latest), or with no name the
        default: the latest live promotion of any name (what requests that
        name no adapter get)."""
        if name is None:
            return conn.execute("SELECT * FROM promotions WHERE rolled_back_at IS NULL "
                                "ORDER BY served_version DESC LIMIT 1").fetchone()
        return conn.execute("SELECT * FROM promotions WHERE rolled_back_at IS NULL AND name=? "
                            "ORDER BY served_version DESC LIMIT 1", (name,)).fetchone()

    def _adapter_view(self, name: str, version: int, conn: sqlite3.Connection | None = None) -> dict[str, Any]:
        conn = conn or self._conn()
        row = conn.execute("SELECT * FROM adapters WHERE name=? AND version=?", (name, version)).fetchone()
        if row is None:
            raise AdapterNotFound(f"no adapter {name!r} version {version}")
        served = self._served_row(conn, name)
        promoted = served is not None and served["version"] == version
        default = self._served_row(conn)
        return {"name": name, "version": version, "path": row["path"], "created": row["created"],
                "job_id": row["job_id"], "eval_loss": row["eval_loss"], "sha256": row["sha256"],
                "drift": json.loads(row["drift"]) if row["drift"] else None, "promoted": promoted,
                "served_version": served["served_version"] if promoted and served is not None else None,
                "default": promoted and default is not None and served is not None
                and default["served_version"] == served["served_version"]}

    def adapters(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every stored adapter version (of `name` only, when given)."""
        with self._read() as conn:
            rows = conn.execute("SELECT name, version FROM adapters WHERE ? IS NULL OR name=? ORDER BY name, version",
                                (name, name)).fetchall()
            return [self._adapter_view(r["name"], r["version"], conn) for r in rows]

    def names(self) -> list[str]:
        """Every adapter name with a stored version."""
        return [r[0] for r in self._conn().execute("SELECT DISTINCT name FROM adapters ORDER BY name")]

    def resident_names(self) -> list[str]:
        """The names with a served version (a live promotion): the adapters resident beside the base."""
        return [r[0] for r in self._conn().execute(
            "SELECT DISTINCT name FROM promotions WHERE rolled_back_at IS NULL ORDER BY name")]

    def served(self, name: str | None = None) -> dict[str, Any] | None:
        """The version serving `name` (no name: the default, what requests naming
        no adapter get), or None: the base model."""
        with self._read() as conn:
            row = self._served_row(conn, name)
            return self._adapter_view(row["name"], row["version"], conn) if row else None

    def served_version(self, name: str | None = None) -> int:
        """The served version number of `name` (no name: the default) that completions report; 0 is the base model."""
        row = self._served_row(self._conn(), name)
        return row["served_version"] if row else 0

    def promotions(self, name: str | None = None) -> list[dict[str, Any]]:
        """The live promotions (of `name`), oldest first (what rollback walks back through)."""
        return [dict(r) for r in self._conn().execute(
            "SELECT served_version, name, version, at FROM promotions WHERE rolled_back_at IS NULL "
            "AND (? IS NULL OR name=?) ORDER BY served_version", (name, name))]

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

    def rollback(self, name: str | None = None) -> dict[str, Any] | None:
        """Undo the latest promotion (of `name`; no name: the latest of any);
        returns what serves it now (None = base)."""
        with self._write() as c:
            row = self._served_row(c, name)
            if row is None:
                raise AdapterNotFound("nothing to roll back: the base model is served" if name is None
                                      else f"nothing to roll back: adapter {name!r} has no served version")
            c.execute("UPDATE promotions SET rolled_back_at=? WHERE served_version=?",
                      (self.clock(), row["served_version"]))
        return self.served(name)

    def retire(self, name: str) -> int:
        """Roll back every live promotion of `name`: it serves nothing and is no
        longer resident (its versions stay stored). Returns how many were undone."""
        with self._write() as c:
            n = c.execute("UPDATE promotions SET rolled_back_at=? WHERE name=? AND rolled_back_at IS NULL",
                          (self.clock(), name)).rowcount
        return n
