"""Receipts: one per dream micro-step, mirroring `struct dream_receipt` (dream.h) field by field.

The field names are the canonical ones (docs/architecture/dream-stage.md,
"Receipts") and travel unchanged into JSON, the job store and the HTTP API.
Sizes are MiB, times ms.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from dreamstage.native.dream_h import DreamReceiptC

STATUS_NAMES = {0: "ok", 1: "refused", 2: "error", 3: "stopped", 4: "aborted"}
RECEIPT_STATUSES = tuple(STATUS_NAMES.values())


@dataclass(frozen=True)
class Receipt:
    # ok | refused | error | stopped (at the step deadline; the next micro-step goes on)
    # | aborted (at the step's time limit, undone; the next micro-step starts the chunk again)
    status: str
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
    aborted_had_ms: float = 0.0   # aborted: the time limit the step had; 0 unless aborted
    aborted_need_ms: float = 0.0  # aborted: the time it needed, estimated
    refused_device: str = ""    # the device (CPU, CUDA0, RPC0, ...) whose need passed its allowance; "" unless refused
    rpc_bytes: int = 0          # bytes sent to and received from RPC workers during the step

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


# The canonical field names, in the C struct's order: the one list in Python.
# The ctypes mirror (dream_h.DreamReceiptC) must name the same members in the
# same order, and it is checked against the compiled struct when the library
# loads (dream_receipt_layout), so a member added on one side only fails at
# import or at load, never as a shifted field.
RECEIPT_FIELDS = tuple(f.name for f in fields(Receipt))


def mirror_mismatch(names: tuple[str, ...], mirror: type[ctypes.Structure] = DreamReceiptC) -> str | None:
    """Why the dataclass's field names and the ctypes mirror's differ (None: they agree)."""
    c_names = tuple(f[0] for f in mirror._fields_)
    if names == c_names:
        return None
    only_py = [n for n in names if n not in c_names]
    only_c = [n for n in c_names if n not in names]
    if only_py or only_c:
        return f"Receipt has {only_py or 'nothing'} that {mirror.__name__} lacks, and lacks {only_c or 'nothing'}"
    return f"Receipt and {mirror.__name__} list the same fields in a different order"


if (_why := mirror_mismatch(RECEIPT_FIELDS)) is not None:
    raise ImportError(f"dreamstage.training.walk.receipts: {_why}")
MEMORY_FIELDS = ("graph_mib", "context_mib", "adapter_mib", "optimizer_mib", "walk_mib")

# A job stores one more kind of receipt beside its micro-steps': a drift
# measurement (docs/architecture/drift.md). It is marked `kind` (a micro-step's
# receipt has no `kind`: it is the native struct's dict unchanged) and carries
# every canonical field too, with the values of a step that walked and trained
# nothing, so whatever reads a job's receipts uniformly (`tokens`, `chunk_tokens`,
# `group_reply`, the memory parts, ...) reads these as well. Built from the
# dataclass at import, so a field added to Receipt without a value here fails
# at import, not in a reader.
RECEIPT_KINDS = ("drift",)
_NOTHING_WALKED = asdict(Receipt(
    status="ok", step=0, window=-1, chunk=0, chunk_pos=0, chunk_tokens=0, context_cache_type="", recompute=False,
    exact=False, horizon=-1, walk_pass="", loss=0.0, tokens=0, ms=0.0, graph_mib=0.0, context_mib=0.0,
    adapter_mib=0.0, optimizer_mib=0.0, walk_mib=0.0, refused_chunk_pos=-1, refused_chunk_tokens=0,
    refused_need_mib=0.0, refused_allowance_mib=0.0, message="", group_reply=-1, aborted_had_ms=0.0,
    aborted_need_ms=0.0, refused_device="", rpc_bytes=0))


def kind_receipt(kind: str, *, step: int, ms: float, memory: dict[str, Any] | None = None, message: str = "",
                 **figures: Any) -> dict[str, Any]:
    """A receipt of `kind` (one of RECEIPT_KINDS) recorded after micro-step `step`
    of a job: the canonical fields of a step that walked nothing (`ms` is the
    time it took, the memory parts what the job held then), `kind`, then its
    own figures, which may not reuse a canonical name."""
    if kind not in RECEIPT_KINDS:
        raise ValueError(f"receipt kind {kind!r} is not one of {', '.join(RECEIPT_KINDS)}")
    clash = sorted(set(figures) & set(RECEIPT_FIELDS))
    if clash:
        raise ValueError(f"a {kind} receipt's figures {clash} would overwrite canonical receipt fields")
    mem = {k: float((memory or {}).get(k) or 0.0) for k in MEMORY_FIELDS}
    return {**_NOTHING_WALKED, "step": step, "ms": ms, **mem, "message": message, "kind": kind, **figures}


def receipt_dict(receipt: Any) -> dict[str, Any]:
    """A receipt (dataclass or mapping) as the JSON dict we store, unchanged."""
    is_instance = dataclasses.is_dataclass(receipt) and not isinstance(receipt, type)
    d = dataclasses.asdict(receipt) if is_instance else dict(receipt)
    status = d.get("status")
    if status not in RECEIPT_STATUSES:
        raise ValueError(f"receipt status {status!r} is not one of {', '.join(RECEIPT_STATUSES)}")
    json.dumps(d, allow_nan=True)  # refuse what cannot be stored, here and not mid-transaction
    return d


class DreamError(RuntimeError):
    """A dream-stage call failed or was refused; `.receipt` says what was measured."""

    def __init__(self, receipt: Receipt):
        super().__init__(f"{receipt.status}: {receipt.message}")
        self.receipt = receipt
