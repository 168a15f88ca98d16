"""Rehearsal data: what the regularizer trains so that a job's adapter keeps
the base's answers on prompts the job never taught.

Each rehearsal anchor (anchors.rehearsal_anchors, and a job's neighbours)
becomes training windows made of its base record (records.AnchorBase): by
default ("soft") its greedy answer trained against the base's recorded
distributions, a cross-entropy whose minimum is the base itself
(docs/architecture/drift.md, "The regularizer (on by default)"). Each epoch visits a rotating
slice of the anchors (anchor_visits); the rehearsal-only epochs after the
job's own visit each once (consolidation_visits).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from dreamstage.training.drift.anchors import rehearsal_anchors
from dreamstage.training.drift.records import ANCHOR_TOKENS, AnchorBase, prompt_tokens
from dreamstage.training.jobs.spec import DEFAULT_REHEARSAL, REHEARSAL_MODES
from dreamstage.training.walk.examples import epoch_order
from dreamstage.training.walk.windows import TrainWindow

T = TypeVar("T")

# Continuations sampled per rehearsal anchor for the sampled modes; a visit
# trains one, the next visit the next (visit_choice).
REHEARSAL_SAMPLES = 4


def rehearsal_samples(mode: str) -> int:
    """Continuations to sample per rehearsal anchor for a job's rehearsal `mode`
    (spec.REHEARSAL_MODES): "soft" trains the greedy answer and needs none."""
    return 0 if mode == "soft" else REHEARSAL_SAMPLES


def soft_targets(ids: np.ndarray, logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Recorded top-K rows (ids, log-probabilities) as soft targets: (ids int32,
    probabilities float32), as recorded, not renormalized. A row sums to the mass
    of its K tokens; the native loss trains what they leave out as one more
    outcome, "any other token" (dream_window_soft_targets), so the target's
    minimum is the base itself (docs/architecture/drift.md, "Soft targets in the
    native walk")."""
    p = np.exp(np.asarray(logp, np.float64))
    s = p.sum(axis=1, keepdims=True)
    p = np.where(s > 1.0, p / s, p)      # rounding: never over one
    return np.ascontiguousarray(ids, np.int32), p.astype(np.float32)


def distillation_window(base: AnchorBase, source: int, label: str, reply: Sequence[int] | None = None,
                        top: tuple[np.ndarray, np.ndarray] | None = None) -> TrainWindow:
    """A distillation example: the anchor's prompt as context, `reply` (the base's
    greedy continuation when None) trained; with `top` (ids, log-probabilities)
    per reply token, against those distributions (soft_targets), not the tokens."""
    reply = tuple(base.continuation if reply is None else reply)
    mask = (0,) * len(base.prompt_tokens) + (1,) * len(reply)
    return TrainWindow(base.prompt_tokens + reply, mask, source, label,
                       soft=None if top is None else soft_targets(*top))


def distillation_windows(base: AnchorBase, source: int, label: str, mode: str | None = None) -> list[TrainWindow]:
    """The regularizer's examples of one anchor (`mode`, a job's `rehearsal`; the default when None):

    - "samples": one per sampled continuation, in sample order, each trained
      on its tokens (the greedy answer when none was sampled);
    - "soft": one, the greedy answer as the records decoded it (`answer`),
      each position trained against the base's recorded distribution there;
    - "soft-samples": one per sample, each position against the distribution
      it was drawn from (the greedy "soft" window when none was sampled)."""
    mode = DEFAULT_REHEARSAL if mode is None else mode
    if mode not in REHEARSAL_MODES:
        raise ValueError(f"rehearsal mode {mode!r} is not one of {', '.join(REHEARSAL_MODES)}")
    if mode == "soft" or (mode == "soft-samples" and not base.sample_top):
        return [distillation_window(base, source, f"{label}.soft", base.answer, (base.top_ids, base.top_logp))]
    if mode == "soft-samples":
        return [distillation_window(base, source, f"{label}.samples[{i}].soft", s, top)
                for i, (s, top) in enumerate(zip(base.samples, base.sample_top, strict=True))]
    if not base.samples:
        return [distillation_window(base, source, label)]
    return [distillation_window(base, source, f"{label}.samples[{i}]", s) for i, s in enumerate(base.samples)]


def rehearsal_windows(base: AnchorBase, index: int, window: int, mode: str | None = None,
                      label: str | None = None) -> list[TrainWindow]:
    """Rehearsal anchor `index`'s windows (distillation_windows) that fit the job's window."""
    return [w for w in distillation_windows(base, -1 - index, label or f"anchors[{index}]", mode) if len(w) <= window]


def rehearsal_window(resident, spec) -> int:
    """The trainer window a job needs for its rehearsal: the job's own `window`,
    or, with the regularizer on, enough for the longest rehearsal anchor (its
    chat-rendered prompt and an answer of ANCHOR_TOKENS), if that is longer, so
    that a short window still rehearses. The job's examples are still cut to
    its `window` (render_job); the scheduler gives the trainer, the walk and the
    guard this one."""
    if not (spec.regularizer and spec.anchor_ratio > 0):
        return spec.window
    longest = max((len(prompt_tokens(resident, p)) for p in rehearsal_anchors()), default=0)
    return max(spec.window, longest + ANCHOR_TOKENS)


def visit_choice(options: Sequence[T], visit: int) -> T:
    """What visit `visit` of a rehearsal anchor trains, of its windows
    `options` (one per sample): the sample visit mod their number, so
    successive visits train different samples."""
    return options[visit % len(options)]


def anchor_visits(n_anchors: int, n_job_windows: int, ratio: float, epoch: int,
                  seed: int) -> list[tuple[int, int]]:
    """The anchors the regularizer trains in `epoch`, each with its visit
    number (0 at its first visit of the job, then 1, ...): ceil(ratio x the
    job's windows) of them (at most all), walking one seeded permutation of
    the whole set cyclically, so every anchor comes round every
    ceil(n_anchors / k) epochs, one visit per round."""
    if not ratio > 0 or n_anchors <= 0 or n_job_windows <= 0:
        return []
    k = min(n_anchors, math.ceil(ratio * n_job_windows))
    perm = np.random.default_rng(seed).permutation(n_anchors)
    return [(int(perm[p % n_anchors]), p // n_anchors) for p in range(epoch * k, epoch * k + k)]


def consolidation_visits(n_anchors: int, epoch: int, seed: int) -> list[tuple[int, int]]:
    """The (anchor, visit) pairs of rehearsal-only epoch `epoch` (0, 1, ... after
    the job's own training): every anchor once, visit number `epoch`, in a seeded order."""
    return [(a, epoch) for a in epoch_order(n_anchors, 1000 + epoch, seed)]


def consolidation_lr(lr: float, begun: int, total: int) -> float:
    """The optimizer's lr for the next window of a job's rehearsal-only epochs
    when their step decays (`consolidate_decay`): `lr` falling linearly to 0
    over their `total` windows, at the middle of window `begun` (0-based), so
    the first update takes almost the whole step and the last almost none."""
    if total <= 0:
        return lr
    return lr * max(0.0, 1.0 - (begun + 0.5) / total)
