"""Records of served answers, the feedback on them, and each adapter's learning setting, kept in the job
store's SQLite database (the same file, the same write lock), so a feedback job and the feedback it
claims commit in one transaction (`claim`): a crash leaves the feedback either pending or in a job,
never both and never neither.

A record is one choice of a served exchange, keyed by (completion id, choice index). Retention
(`RecordPolicy`): records older than `days` go, then the oldest while their bytes pass `mib`; enforced on
every write and when the store opens. Feedback keeps its own copy of what it trains (the prompt tokens
and the rendered replies), so a record that expires or is deleted after its feedback loses nothing.
"""
from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dreamstage.training.jobs.store import JobStore

RECORD_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    created REAL NOT NULL,
    adapter TEXT,                 -- the adapter name that answered (NULL: the base model)
    body TEXT NOT NULL,           -- the ServedAnswer as JSON
    bytes INTEGER NOT NULL,
    PRIMARY KEY (id, idx)
);
CREATE INDEX IF NOT EXISTS records_created ON records(created);
CREATE INDEX IF NOT EXISTS records_adapter ON records(adapter, created);
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    adapter TEXT NOT NULL,        -- the adapter name it trains
    record_id TEXT NOT NULL,
    kind TEXT NOT NULL,           -- correction | rating | preference
    prompt_key TEXT NOT NULL,     -- ratings with one key (adapter and prompt tokens) form one group
    body TEXT NOT NULL,           -- what it trains: {"prompt": [ids], "replies": [...]}
    job_id INTEGER REFERENCES jobs(id)   -- NULL while pending
);
CREATE INDEX IF NOT EXISTS feedback_pending ON feedback(adapter, job_id);
CREATE TABLE IF NOT EXISTS learning (
    name TEXT PRIMARY KEY,
    mode TEXT NOT NULL,
    examples INTEGER NOT NULL,
    minutes REAL NOT NULL
);
"""

LearnMode = Literal["manual", "auto"]
LEARN_MODES: tuple[LearnMode, ...] = ("manual", "auto")
DEFAULT_LEARN_MODE: LearnMode = "manual"
DEFAULT_LEARN_EXAMPLES = 8        # auto: a job starts once this many feedback items are pending
DEFAULT_LEARN_MINUTES = 2.0       # auto: or this long after the last one, whichever comes first
DEFAULT_RECORD_DAYS = 30.0
DEFAULT_LEARN_ADAPTER = "learned"   # what feedback on the base model's answers trains (--learn-adapter)
DEFAULT_RECORD_MIB = 256.0


@dataclass(frozen=True)
class RecordPolicy:
    days: float = DEFAULT_RECORD_DAYS
    mib: float = DEFAULT_RECORD_MIB


@dataclass(frozen=True)
class LearnSettings:
    mode: LearnMode = DEFAULT_LEARN_MODE
    examples: int = DEFAULT_LEARN_EXAMPLES
    minutes: float = DEFAULT_LEARN_MINUTES


@dataclass(frozen=True)
class ServedAnswer:
    """One choice of a served exchange, as it was decoded."""

    id: str                       # the completion id the response carried
    index: int                    # the choice
    kind: Literal["chat", "completion"]
    prompt_tokens: list[int]      # exactly what was decoded
    answer: str
    finish_reason: str
    adapter: str | None           # the adapter name that answered; None: the base model
    adapter_version: int          # its file version (0: the base)
    served_version: int | None    # the promotion it served under (None: a pinned version)
    sampling: dict[str, Any]
    messages: list[dict[str, Any]] | None = None   # chat: the conversation as the template rendered it
    tools: list[dict[str, Any]] | None = None      # chat: tools the template read natively
    prompt: str | None = None                      # completion: the prompt's text (None: given as token ids)
    created: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def view(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "extra"}


@dataclass(frozen=True)
class Feedback:
    id: int
    created: float
    adapter: str
    record_id: str
    kind: str
    prompt_key: str
    body: dict[str, Any]
    job_id: int | None

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "adapter": self.adapter, "record_id": self.record_id,
                "kind": self.kind, "job_id": self.job_id, "pending": self.job_id is None,
                "replies": [{k: r[k] for k in ("text", "weight", "rating", "index", "record_id") if k in r}
                            for r in self.body["replies"]]}


def _answer(row: sqlite3.Row) -> ServedAnswer:
    return ServedAnswer(**json.loads(row["body"]))


def _feedback(row: sqlite3.Row) -> Feedback:
    return Feedback(row["id"], row["created"], row["adapter"], row["record_id"], row["kind"], row["prompt_key"],
                    json.loads(row["body"]), row["job_id"])


class RecordStore:
    """Records, feedback and learning settings beside `jobs` (its database, its locks)."""

    def __init__(self, jobs: JobStore, policy: RecordPolicy | None = None):
        self.jobs = jobs
        self.policy = policy or RecordPolicy()
        with self.jobs.transaction() as c:
            for statement in RECORD_SCHEMA.split(";"):
                if statement.strip():
                    c.execute(statement)
        self.enforce()

    # -- records ---------------------------------------------------------------------------------
    def add(self, answers: Iterable[ServedAnswer]) -> None:
        """Keep these answers (one exchange's choices), then apply the retention policy."""
        now = self.jobs.clock()
        rows = []
        for a in answers:
            body = json.dumps({**asdict(a), "created": now}, separators=(",", ":"))
            rows.append((a.id, a.index, now, a.adapter, body, len(body)))
        with self.jobs.transaction(durable=False) as c:
            c.executemany("INSERT OR REPLACE INTO records (id, idx, created, adapter, body, bytes) "
                          "VALUES (?, ?, ?, ?, ?, ?)", rows)
            self._enforce(c)

    def enforce(self) -> int:
        """Apply the retention policy now; returns the records removed."""
        with self.jobs.transaction(durable=False) as c:
            return self._enforce(c)

    def _enforce(self, c: sqlite3.Connection) -> int:
        cutoff = self.jobs.clock() - self.policy.days * 86400.0
        gone = c.execute("DELETE FROM records WHERE created < ?", (cutoff,)).rowcount
        cap = int(self.policy.mib * (1 << 20))
        total = c.execute("SELECT COALESCE(SUM(bytes), 0) FROM records").fetchone()[0]
        if total > cap:
            # the oldest first, until what is left fits
            over, drop = total - cap, []
            for row in c.execute("SELECT id, idx, bytes FROM records ORDER BY created, id, idx"):
                if over <= 0:
                    break
                drop.append((row["id"], row["idx"]))
                over -= row["bytes"]
            c.executemany("DELETE FROM records WHERE id=? AND idx=?", drop)
            gone += len(drop)
        return gone

    def get(self, record_id: str) -> list[ServedAnswer]:
        """Every choice recorded under `record_id`, by index ([] when none)."""
        with self.jobs.reading() as c:
            return [_answer(r) for r in c.execute("SELECT body FROM records WHERE id=? ORDER BY idx", (record_id,))]

    def answer(self, record_id: str, index: int) -> ServedAnswer | None:
        with self.jobs.reading() as c:
            row = c.execute("SELECT body FROM records WHERE id=? AND idx=?", (record_id, index)).fetchone()
        return _answer(row) if row is not None else None

    def recent(self, adapter: str | None = None, names: frozenset[str] | None = None, limit: int = 100,
             before: float | None = None) -> list[ServedAnswer]:
        """The newest records first: of `adapter` ("base": the base model's), within `names` (a scoped key's
        adapters; the base model's records are outside every scope), older than `before`."""
        where, args = ["1=1"], list[Any]()
        if adapter is not None:
            where.append("adapter IS NULL" if adapter == "base" else "adapter=?")
            args += [] if adapter == "base" else [adapter]
        if names is not None:
            where.append(f"adapter IN ({','.join('?' * len(names))})")
            args += sorted(names)
        if before is not None:
            where.append("created < ?")
            args.append(before)
        with self.jobs.reading() as c:
            rows = c.execute(f"SELECT body FROM records WHERE {' AND '.join(where)} "
                             "ORDER BY created DESC, id, idx LIMIT ?", (*args, limit)).fetchall()
        return [_answer(r) for r in rows]

    def delete(self, record_id: str) -> int:
        with self.jobs.transaction() as c:
            return c.execute("DELETE FROM records WHERE id=?", (record_id,)).rowcount

    def delete_adapter(self, name: str) -> int:
        with self.jobs.transaction() as c:
            return c.execute("DELETE FROM records WHERE adapter=?", (name,)).rowcount

    def totals(self) -> tuple[int, int]:
        """(records, bytes) kept now."""
        with self.jobs.reading() as c:
            n, b = c.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM records").fetchone()
        return int(n), int(b)

    # -- feedback --------------------------------------------------------------------------------
    def add_feedback(self, adapter: str, record_id: str, kind: str, prompt_key: str, body: dict[str, Any]) -> int:
        """Keep one feedback item, pending, committed durably before it returns."""
        with self.jobs.transaction() as c:
            cur = c.execute("INSERT INTO feedback (created, adapter, record_id, kind, prompt_key, body) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (self.jobs.clock(), adapter, record_id, kind, prompt_key,
                             json.dumps(body, separators=(",", ":"))))
            assert cur.lastrowid is not None
            return cur.lastrowid

    def pending(self, adapter: str) -> list[Feedback]:
        with self.jobs.reading() as c:
            return [_feedback(r) for r in c.execute(
                "SELECT * FROM feedback WHERE adapter=? AND job_id IS NULL ORDER BY id", (adapter,))]

    def feedback(self, adapter: str | None = None, job_id: int | None = None, limit: int = 1000) -> list[Feedback]:
        """Feedback of `adapter` (and of `job_id`), newest first."""
        with self.jobs.reading() as c:
            return [_feedback(r) for r in c.execute(
                "SELECT * FROM feedback WHERE (? IS NULL OR adapter=?) AND (? IS NULL OR job_id=?) "
                "ORDER BY id DESC LIMIT ?", (adapter, adapter, job_id, job_id, limit))]

    def feedback_item(self, feedback_id: int) -> Feedback | None:
        with self.jobs.reading() as c:
            row = c.execute("SELECT * FROM feedback WHERE id=?", (feedback_id,)).fetchone()
        return _feedback(row) if row is not None else None

    def delete_pending(self, feedback_id: int) -> bool:
        """Delete a pending item; False when a job has it (or it is gone)."""
        with self.jobs.transaction() as c:
            return c.execute("DELETE FROM feedback WHERE id=? AND job_id IS NULL", (feedback_id,)).rowcount == 1

    def pending_counts(self) -> dict[str, tuple[int, float]]:
        """Per adapter: (pending items, when the last one came)."""
        with self.jobs.reading() as c:
            return {r[0]: (int(r[1]), float(r[2])) for r in c.execute(
                "SELECT adapter, COUNT(*), MAX(created) FROM feedback WHERE job_id IS NULL GROUP BY adapter")}

    def feedback_counts(self) -> dict[str, int]:
        """received (every item), pending (no job yet), training (in a job not ended), used (in a job that
        finished `done`), dropped (in a job that ended otherwise)."""
        with self.jobs.reading() as c:
            rows = c.execute("SELECT f.job_id AS job, j.state AS state, COUNT(*) AS n FROM feedback f "
                             "LEFT JOIN jobs j ON j.id = f.job_id GROUP BY f.job_id IS NULL, j.state").fetchall()
        out = dict.fromkeys(("received", "pending", "training", "used", "dropped"), 0)
        for r in rows:
            out["received"] += r["n"]
            key = ("pending" if r["job"] is None else "used" if r["state"] == "done"
                   else "training" if r["state"] in ("queued", "starting", "running", "paused", "held") else "dropped")
            out[key] += r["n"]
        return out

    def claim(self, feedback_ids: list[int]) -> Callable[[sqlite3.Connection, int], None]:
        """What JobStore.submit runs inside the job's own transaction: these pending items become the job's.
        Raises LookupError (the job is not stored) when one was claimed meanwhile."""
        def within(c: sqlite3.Connection, job_id: int) -> None:
            marks = ",".join("?" * len(feedback_ids))
            n = c.execute(f"UPDATE feedback SET job_id=? WHERE id IN ({marks}) AND job_id IS NULL",
                          (job_id, *feedback_ids)).rowcount
            if n != len(feedback_ids):
                raise LookupError(f"feedback {feedback_ids} was claimed by another job meanwhile")
        return within

    def release_interrupted(self) -> int:
        """Feedback of jobs that were interrupted (the server stopped mid-job: no version came of it) is
        pending again; returns how many items."""
        with self.jobs.transaction() as c:
            return c.execute("UPDATE feedback SET job_id=NULL WHERE job_id IN "
                             "(SELECT id FROM jobs WHERE state='interrupted')").rowcount

    def open_job(self, adapter: str) -> int | None:
        """A feedback job of `adapter` not ended yet (queued or training), if any."""
        with self.jobs.reading() as c:
            row = c.execute("SELECT MIN(f.job_id) FROM feedback f JOIN jobs j ON j.id = f.job_id WHERE f.adapter=? "
                            "AND j.state IN ('queued', 'starting', 'running', 'paused', 'held')", (adapter,)).fetchone()
        return row[0]

    def versions_learned(self, name: str) -> dict[int, list[int]]:
        """Per stored version of `name`: the feedback ids its job learned from."""
        with self.jobs.reading() as c:
            rows = c.execute("SELECT a.version AS version, f.id AS id FROM adapters a JOIN feedback f "
                             "ON f.job_id = a.job_id WHERE a.name=? ORDER BY a.version, f.id", (name,)).fetchall()
        out: dict[int, list[int]] = {}
        for r in rows:
            out.setdefault(r["version"], []).append(r["id"])
        return out

    # -- learning settings -----------------------------------------------------------------------
    def learning(self, name: str) -> LearnSettings:
        with self.jobs.reading() as c:
            row = c.execute("SELECT mode, examples, minutes FROM learning WHERE name=?", (name,)).fetchone()
        return LearnSettings(row["mode"], row["examples"], row["minutes"]) if row is not None else LearnSettings()

    def set_learning(self, name: str, settings: LearnSettings) -> LearnSettings:
        with self.jobs.transaction() as c:
            c.execute("INSERT OR REPLACE INTO learning (name, mode, examples, minutes) VALUES (?, ?, ?, ?)",
                      (name, settings.mode, settings.examples, settings.minutes))
        return settings

    def auto_names(self) -> list[str]:
        with self.jobs.reading() as c:
            return [r[0] for r in c.execute("SELECT name FROM learning WHERE mode='auto' ORDER BY name")]
