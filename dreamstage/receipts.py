"""Receipts: one per dream micro-step, mirroring `struct dream_receipt` (dream.h) field by field.

The field names are the canonical ones of DESIGN-BRIEF section 5 and travel
unchanged into JSON, the job store and the HTTP API. Sizes are MiB, times ms.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

from dreamstage.native import DreamReceiptC

STATUS_NAMES = {0: "ok", 1: "refused", 2: "error"}


@dataclass(frozen=True)
class Receipt:
    status: str                 # ok | refused | error
    step: int
    window: int
    chunk: int
    chunk_pos: int
    chunk_tokens: int
    context_cache_type: str
    recompute: bool
    exact: bool
    horizon: int                # exact walk: ancestors in use that receive gradient (0: whole window); -1: plain walk
    walk_pass: str              # "forward" (cache filled only) | "backward" (forward and backward)
    loss: float                 # mean CE over this chunk's loss tokens (0.0 when tokens == 0)
    tokens: int                 # loss tokens in this chunk
    ms: float
    graph_mib: float
    context_mib: float
    adapter_mib: float
    optimizer_mib: float
    walk_mib: float
    refused_chunk_pos: int      # -1 unless refused
    refused_chunk_tokens: int
    refused_need_mib: float
    refused_allowance_mib: float
    message: str
    group_reply: int = -1       # shared-prefix group: the reply this chunk walked, G for the shared prefix; -1: none

    @classmethod
    def from_c(cls, c: DreamReceiptC) -> Receipt:
        values = {}
        for f in fields(cls):
            v = getattr(c, f.name)
            if f.name == "status":
                v = STATUS_NAMES.get(v, f"unknown({v})")
            elif isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            values[f.name] = v
        return cls(**values)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    def with_clear_allowance(self, budget_mib: float | None, slack_mib: float) -> Receipt:
        """This receipt, or, when the gate computed a negative allowance, a copy
        whose allowance is 0 and whose message says why.

        The native gate subtracts its slack from min(budget left, device free);
        when that is below the slack the difference is negative, and "allowance
        -63 MiB" explains nothing. The measured need and every other field stay."""
        if self.refused_allowance_mib >= 0:
            return self
        short = -self.refused_allowance_mib
        source = (f"min(memory_budget_mib {budget_mib:g} MiB less what the job already holds, the device's free memory)"
                  if budget_mib else "the device's free memory")
        why = (f"nothing is left for the job: the memory gate keeps {slack_mib:g} MiB free, and {source} "
               f"is {short:.2f} MiB below that slack, so the allowance is 0 MiB")
        return replace(self, refused_allowance_mib=0.0, message=f"{why}; {self.message}" if self.message else why)


class DreamError(RuntimeError):
    """A dream-stage call failed or was refused; `.receipt` says what was measured."""

    def __init__(self, receipt: Receipt):
        super().__init__(f"{receipt.status}: {receipt.message}")
        self.receipt = receipt
