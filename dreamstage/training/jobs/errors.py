"""The job store's errors (InvalidTransition, which names the state machine's moves, is store.py's;
AdapterNotFound is adapters/versions.py's)."""
from __future__ import annotations


class JobError(Exception):
    pass


class JobNotFound(JobError, KeyError):
    def __init__(self, job_id: int):
        self.job_id = job_id
        super().__init__(f"no job {job_id}")

    def __str__(self) -> str:
        return self.args[0]
