"""The live promotions as replicas share them (docs/architecture/replicas.md).

The leader's `generation` tells a follower that its promotions changed
(GET /adapters?since=); `mirror_promotions` books the leader's live set on a
follower under the leader's served versions. Both read and write the job
store's promotions table through its public transactions.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dreamstage.adapters.versions import AdapterVersions


def generation(store: AdapterVersions) -> int:
    """A counter that grows with every change of the live promotions: each promotion adds a
    row (a higher served version), each rollback marks one."""
    with store.reading() as conn:
        row = conn.execute("SELECT COALESCE(MAX(served_version), 0), COUNT(rolled_back_at) "
                           "FROM promotions").fetchone()
    return row[0] + row[1]


def mirror_promotions(store: AdapterVersions, live: Sequence[tuple[int, str, int]]) -> None:
    """A follower's booking: make the live promotions exactly `live`, (served_version, name,
    version) as the leader numbers them, in one transaction; every other row is rolled back.
    Each (name, version) must be stored already."""
    want = {sv: (name, version) for sv, name, version in live}
    now = store.clock()
    with store.transaction() as c:
        for sv, name, version in c.execute("SELECT served_version, name, version FROM promotions "
                                           "WHERE rolled_back_at IS NULL").fetchall():
            if want.get(sv) != (name, version):
                c.execute("UPDATE promotions SET rolled_back_at=? WHERE served_version=?", (now, sv))
        for sv, (name, version) in want.items():
            c.execute("INSERT INTO promotions (served_version, name, version, at) VALUES (?, ?, ?, ?) "
                      "ON CONFLICT(served_version) DO UPDATE SET name=excluded.name, version=excluded.version, "
                      "at=excluded.at, rolled_back_at=NULL "
                      "WHERE rolled_back_at IS NOT NULL OR name IS NOT excluded.name "
                      "OR version IS NOT excluded.version", (sv, name, version, now))
