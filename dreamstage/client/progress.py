"""A training job's progress as GET /train/{id} reports it, read for a terminal:
windows done, the ETA, one line with a bar (the client's `wait` and `dreamstage train`).
"""
from __future__ import annotations

FINAL_STATES = frozenset({"done", "cancelled", "refused", "error", "interrupted"})


def progress_fraction(job: dict) -> tuple[int, int]:
    """(windows done, windows in all) over every epoch."""
    p = job.get("progress") or {}
    windows, epochs = p.get("windows") or 0, p.get("epochs") or 1
    total = windows * epochs
    done = min(total, (p.get("epoch") or 0) * windows + (p.get("window_in_epoch") or 0)) if total else 0
    if job.get("state") == "done":
        done = total
    return done, total


def eta_s(job: dict) -> float | None:
    """Seconds left at the rate so far (windows per second since the job started).

    Both ends are the server's clock (`started`, `updated`), so a client on
    another machine gets no skew; None before the first window or after the end."""
    done, total = progress_fraction(job)
    started, updated = job.get("started"), job.get("updated")
    if job.get("state") != "running" or not started or not updated or not 0 < done < total:
        return None
    return (updated - started) / done * (total - done)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(job: dict, width: int = 24) -> str:
    """One line for a job: a bar over epochs x windows, then state, step, loss, tok/s and ETA."""
    p = job.get("progress") or {}
    epochs = p.get("epochs") or 1
    done, total = progress_fraction(job)
    frac = done / total if total else 0.0
    bar = "#" * round(frac * width) + "." * (width - round(frac * width))
    loss = p.get("loss_avg")
    parts = [f"job {job.get('id')} [{bar}] {frac:4.0%}", job.get("state", "?"),
             f"step {p.get('step', 0)}", f"epoch {min((p.get('epoch') or 0) + 1, epochs)}/{epochs}"]
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if p.get("eval_loss") is not None:
        parts.append(f"eval {p['eval_loss']:.3f}")
    if p.get("train_tok_s") is not None:
        parts.append(f"{p['train_tok_s']:.1f} tok/s")
    eta = eta_s(job)
    if eta is not None:
        parts.append(f"ETA {format_duration(eta)}")
    if p.get("horizon") is not None:
        parts.append(f"exact horizon {p['horizon'] or 'all'}")
    if p.get("refusals"):
        parts.append(f"refusals {p['refusals']}")
    return "  ".join(parts)

