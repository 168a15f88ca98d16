"""The one promotion rule: whether a finished job's adapter is served (promote="auto").

`promotion_decision` reads the held-out losses before and after training and,
when the drift guard ran, the drift figures against the job's bounds. It
returns (promote, reason); the reason is what the job's message says.
"""
from __future__ import annotations

from dreamstage.training.drift.measure import Drift, summary


def promotion_decision(eval_before: float | None, eval_after: float | None, drift: Drift | None = None,
                       max_drift: float = 1.0, max_drift_kl: float | None = None,
                       failure: str | None = None, *, guarded: bool = True) -> tuple[bool, str]:
    """Promote when the held-out loss is no worse than before training (nothing
    held out: no evidence either way, promoted) and, with the guard on
    (`guarded`), anchors_changed <= max_drift and drift_kl <= max_drift_kl (when
    bounded). With the guard on, an unmeasured drift holds: unmeasured damage is
    not served."""
    if eval_before is None or eval_after is None:
        held, held_ok = "nothing held out", True
    else:
        held_ok = eval_after <= eval_before
        held = f"held-out loss {eval_after:.4f} {'is no worse than' if held_ok else 'is worse than'} {eval_before:.4f}"
    if not guarded:
        if eval_before is None or eval_after is None:
            return True, f"{held}; promoted on completion"
        return held_ok, held if held_ok else f"{held}; not promoted"
    if drift is None:
        return False, f"{held}; drift not measured ({failure or 'no anchors'}); not promoted"
    if drift.anchors_changed > max_drift + 1e-12:
        return False, f"{held}; {summary(drift)} exceeds max_drift {max_drift:g}; not promoted"
    if max_drift_kl is not None and drift.drift_kl > max_drift_kl:
        return False, f"{held}; {summary(drift)} exceeds max_drift_kl {max_drift_kl:g}; not promoted"
    if not held_ok:
        return False, f"{held}; {summary(drift)}; not promoted"
    bounds = f"max_drift {max_drift:g}" + (f", max_drift_kl {max_drift_kl:g}" if max_drift_kl is not None else "")
    return True, f"{held}; {summary(drift)} within {bounds}"
