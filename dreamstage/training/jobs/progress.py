"""A job's progress: receipts folded into the figures GET /train/{id} reports.

The progress is one JSON object stored in the job's row. Public fields are
what the API shows; fields starting with `_` are running sums the folds need
(they never leave the store). Pure functions on that dict: the store applies
them inside its write transactions.

Names: `window_in_epoch` is the position of the window being trained in this
epoch's order (0-based; `windows` of them per epoch); `current_chunk` is the
chunk size in use now (the job's `chunk` until a refusal halves it). A size
of a window is only ever called `window`, as in the request and the receipts.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dreamstage.training.jobs.spec import JobSpec
from dreamstage.training.walk.receipts import MEMORY_FIELDS, RECEIPT_FIELDS

# what progress.drift_history keeps of each drift measurement
DRIFT_HISTORY_FIELDS = ("epoch", "step", "final", "anchors", "anchors_changed", "drift_kl")
LOSS_EMA_BETA = 0.9  # moving average over finished windows, bias-corrected


def new_progress(spec: JobSpec) -> dict[str, Any]:
    return {
        # the drift guard's records of the measured anchors: {"measured", "of", "pending"} (None: no guard yet)
        "drift_records": None,
        "step": 0, "window_in_epoch": 0, "windows": None, "windows_done": 0, "epoch": 0, "epochs": spec.epochs,
        # tokens: loss tokens trained; walked: tokens run forward+backward
        # (chunk_tokens); train_tok_s = walked per second of micro-step time.
        "tokens": 0, "walked": 0, "train_ms": 0.0, "train_tok_s": None, "current_chunk": spec.chunk,
        "refusals": 0,
        # micro-steps stopped at the pause deadline (the next one went on with
        # the chunk) and the time of their parts (in train_ms too)
        "stopped": 0, "stopped_ms": 0.0,
        # micro-steps aborted at the step's time limit and undone (the chunk ran
        # again later) and the time they took (not in train_ms: nothing came of it)
        "aborted": 0, "aborted_ms": 0.0,
        # bytes to and from RPC workers: every micro-step's, and the last one's (0 without workers)
        "rpc_bytes": 0, "rpc_bytes_per_step": 0,
        # the exact walk: the horizon in use (0: whole window; None: plain walk)
        # and the last micro-step's pass (forward | backward)
        "horizon": (spec.horizon or 0) if spec.exact else None, "walk_pass": None,
        "loss": None, "loss_avg": None, "train_loss": None, "eval_loss": None,
        "train_loss_per_epoch": [], "eval_loss_per_epoch": [],
        # the job's own windows only (the loss train_loss_per_epoch mixes with the
        # drift guard's rehearsal windows, which starts at the base's entropy);
        # null for a rehearsal-only epoch, which trains none of them
        "examples_loss_per_epoch": [],
        # the last drift measurement (docs/architecture/drift.md), null until one
        # ran, and every one in order (those during training cover a slice of the anchors)
        "drift": None, "drift_history": [],
        "memory": {k: None for k in MEMORY_FIELDS},
        # shared-prefix groups: per group label, its structure (prefix_tokens, G,
        # reply_tokens, weights, shared_prefix) and its last walk's per-reply losses
        "groups": {},
        # accumulators for the epoch in progress and the moving average
        "_win_loss_sum": 0.0, "_win_tokens": 0, "_epoch_loss_sum": 0.0, "_epoch_tokens": 0,
        "_ema": 0.0, "_ema_n": 0,
    }


def fold_receipt(p: dict[str, Any], d: Mapping[str, Any]) -> None:
    """One micro-step's receipt (as stored) into the progress."""
    if d.get("kind") == "drift":                # a drift measurement, not a micro-step
        # its figures, and the micro-step it followed and its own time; the other
        # canonical fields of a drift receipt are those of a step that walked nothing
        p["drift"] = {k: v for k, v in d.items() if k not in RECEIPT_FIELDS or k in ("step", "ms")}
        p["drift"].pop("kind")
        p.setdefault("drift_history", []).append(   # a job stored before the history had none
            {k: p["drift"].get(k) for k in DRIFT_HISTORY_FIELDS})
        return
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
    elif d["status"] == "stopped":
        ms = float(d.get("ms") or 0.0)
        p["stopped"] = p.get("stopped", 0) + 1          # (a job stored before stops had neither)
        p["stopped_ms"] = p.get("stopped_ms", 0.0) + ms
        p["train_ms"] += ms                             # the step's first part: its time trained too
    elif d["status"] == "aborted":
        p["aborted"] = p.get("aborted", 0) + 1          # (a job stored before aborts had neither)
        p["aborted_ms"] = p.get("aborted_ms", 0.0) + float(d.get("ms") or 0.0)
    if d.get("rpc_bytes") is not None:
        p["rpc_bytes"] = p.get("rpc_bytes", 0) + int(d["rpc_bytes"])   # (a job stored before workers had none)
        p["rpc_bytes_per_step"] = int(d["rpc_bytes"])
    if d.get("group"):
        g = dict(d["group"])
        p.setdefault("groups", {})[g.pop("label")] = g
    if d.get("exact") and d.get("horizon") is not None and d.get("group_reply", -1) < 0:
        p["horizon"] = d["horizon"]      # in use (0: the whole window); a halving refusal names the new one
    if d.get("chunk") is not None:
        p["current_chunk"] = d["chunk"]


def close_window(p: dict[str, Any]) -> float | None:
    """Close the window the last ok receipts belong to. Its loss is the
    token-weighted mean of their chunk losses (a receipt's `loss` is the mean
    CE over that chunk's `tokens` loss tokens); it feeds the moving average
    and the epoch's train loss. Returns it (None: no loss tokens)."""
    tokens, loss_sum = p["_win_tokens"], p["_win_loss_sum"]
    p["_win_tokens"], p["_win_loss_sum"] = 0, 0.0
    p["windows_done"] += 1
    if not tokens:
        return None
    loss = loss_sum / tokens
    p["_epoch_loss_sum"] += loss_sum
    p["_epoch_tokens"] += tokens
    p["_ema"] = LOSS_EMA_BETA * p["_ema"] + (1 - LOSS_EMA_BETA) * loss
    p["_ema_n"] += 1
    p["loss"] = loss
    p["loss_avg"] = p["_ema"] / (1 - LOSS_EMA_BETA ** p["_ema_n"])
    return loss


def restart_window(p: dict[str, Any]) -> None:
    """The window in progress starts again from its beginning (a held job resumed from the
    checkpoint taken there): its chunks' losses so far no longer count toward its loss."""
    p["_win_tokens"], p["_win_loss_sum"] = 0, 0.0


def close_epoch(p: dict[str, Any], eval_loss: float | None, examples_loss: float | None = None) -> None:
    """Close the epoch: its token-weighted train loss, held-out loss (None
    when nothing is held out) and the job's own windows' loss (None when it
    trained none of them)."""
    train = p["_epoch_loss_sum"] / p["_epoch_tokens"] if p["_epoch_tokens"] else None
    p["train_loss_per_epoch"].append(train)
    p["eval_loss_per_epoch"].append(eval_loss)
    own = p.setdefault("examples_loss_per_epoch", [])      # a job stored before it was kept: null for those epochs
    own.extend([None] * (len(p["train_loss_per_epoch"]) - 1 - len(own)))
    own.append(examples_loss)
    p["train_loss"], p["eval_loss"] = train, eval_loss
    p["_epoch_loss_sum"], p["_epoch_tokens"] = 0.0, 0
    p["epoch"] = len(p["train_loss_per_epoch"])


def public_progress(p: Mapping[str, Any]) -> dict[str, Any]:
    """What the API shows: no running sums, and memory reported beside it."""
    return {k: v for k, v in p.items() if not k.startswith("_") and k != "memory"}
