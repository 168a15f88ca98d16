"""When a shared-prefix group pays: the micro-steps of each path and a measured cost model.

A group of G replies to one prompt of P tokens can train as one group walk
(`Trainer.train_group`: the shared P - 1 cells forward once and backward once,
each reply a child chunk) or as G separate windows (prompt + reply). Both give
the same gradient in the exact walk; the group does P + G*D tokens of work
instead of G*(P + D), but takes more micro-steps than one short window, and the
shared cells run forward twice (once before the replies, once in their
backward). So it loses for G = 1 and for short prompts, and wins big for long
prompts (docs/benchmarks.md, bench/bench_groups.py).

The choice is a cost model fitted to the micro-steps' own receipts: a step
costs `fixed + per_token * tokens` ms, one line for forward-only steps and one
for forward-and-backward steps. `prefer_group` lists each path's micro-steps
exactly as the native walks schedule them and picks the cheaper.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dreamstage.training.walk.windows import TrainWindow

# A negative weight pushes its reply's tokens down, and -w * CE has no floor: trained long enough, the
# reply's NLL (and the adapter) would run away. So once a negative-weight reply's mean NLL, as its group's
# last pass measured it, has risen NEGATIVE_NLL_RISE above its first pass's (its tokens at e^-1 = 37% of
# the probability they had, on average), or passed NEGATIVE_NLL_CAP whatever it began at, the next pass drops
# its term; should other training pull it back under, the term returns (a hinge). Pushed to the cap alone,
# one answer rated -1 beside one rated +1 reached 9 nats and changed every anchor the guard measured
# (docs/benchmarks.md, "Learning from feedback").
NEGATIVE_NLL_CAP = 6.0
NEGATIVE_NLL_RISE = 1.0


def pushed_away(last: float, first: float | None) -> bool:
    """Whether a negative-weight reply whose mean NLL was `first` at its group's first pass and `last` at
    its latest is pushed far enough (a NaN: not measured, not pushed)."""
    if not math.isfinite(last):
        return False
    bound = NEGATIVE_NLL_CAP if first is None or not math.isfinite(first) else min(
        NEGATIVE_NLL_CAP, first + NEGATIVE_NLL_RISE)
    return last > bound


def bounded_weights(weights: Sequence[float], last_losses: Sequence[float] | None,
                    first_losses: Sequence[float] | None = None) -> list[float]:
    """The weights a group's next pass trains with: a negative-weight reply `pushed_away` weighs 0
    (docs/architecture/groups.md, "Negative weights")."""
    if last_losses is None or len(last_losses) != len(weights):
        return [float(w) for w in weights]
    first = list(first_losses) if first_losses is not None and len(first_losses) == len(weights) else [
        None] * len(weights)
    return [0.0 if w < 0 and pushed_away(loss, f) else float(w)
            for w, loss, f in zip(weights, last_losses, first, strict=True)]


@dataclass(frozen=True)
class StepCost:
    """ms per micro-step: fixed + per_token * tokens, for forward-only and backward steps."""

    fwd_fixed_ms: float
    fwd_ms_per_token: float
    bwd_fixed_ms: float
    bwd_ms_per_token: float

    def step_ms(self, kind: str, tokens: int) -> float:
        if kind == "forward":
            return self.fwd_fixed_ms + self.fwd_ms_per_token * tokens
        return self.bwd_fixed_ms + self.bwd_ms_per_token * tokens


# Measured on the 2-core project machine (default model, rank 8 on attn_q/attn_v,
# q8_0 cache, one thread): the backward line is fit_cost over the receipts of one
# P=512, D=16, G=8 run of bench/bench_groups.py (both paths); its forward steps all
# had 256 tokens (6.6 ms/token), so the forward's fixed cost (40 ms) is a guess.
# Over the whole grid the predicted ratio lands within 10% of the measured CPU-time
# ratio at 22 of 24 points (15% off at the smallest, P=16, G=2), and picks wrongly
# only at break-even points, costing at most 8% (docs/benchmarks.md); the grid's
# own fit under load (`cost_fitted` in bench/results/groups.json) picks the same
# paths. Only the ratio of the two paths matters, so a faster machine with the same shape of costs picks alike.
DEFAULT_COST = StepCost(fwd_fixed_ms=40.0, fwd_ms_per_token=6.6, bwd_fixed_ms=230.0, bwd_ms_per_token=13.7)


def _chunks(lo: int, hi: int, chunk: int) -> list[int]:
    """Sizes of the chunks covering [lo, hi) from lo."""
    return [min(chunk, hi - p) for p in range(lo, hi, chunk)]


def _reverse(lo: int, end: int, chunk: int) -> list[tuple[str, int]]:
    """An exact reverse pass over [lo, end) on the chunk grid from lo: the forward
    sweep up to the last chunk's start, then every chunk back to lo."""
    if end <= lo:
        return []
    start = lo + ((end - 1 - lo) // chunk) * chunk
    steps = [("forward", n) for n in _chunks(lo, start, chunk)]
    return steps + [("backward", end - start)] + [("backward", n) for n in reversed(_chunks(lo, start, chunk))]


def group_steps(n_prefix: int, reply_lengths: Sequence[int], chunk: int) -> list[tuple[str, int]]:
    """The group walk's micro-steps (dream-groups.cpp) for fully labelled replies."""
    shared = n_prefix - 1
    steps = [("forward", n) for n in _chunks(0, shared, chunk)]
    for d in reply_lengths:
        steps += _reverse(shared, shared + d, chunk)
    return steps + [("backward", n) for n in reversed(_chunks(0, shared, chunk))]


def separate_steps(n_prefix: int, reply_lengths: Sequence[int], chunk: int, exact: bool) -> list[tuple[str, int]]:
    """The micro-steps of G separate windows (prompt + reply, the prompt unlabelled)."""
    steps: list[tuple[str, int]] = []
    for d in reply_lengths:
        n = n_prefix + d
        if exact:
            steps += _reverse(0, n - 1, chunk)   # the last token is never an input
        else:
            # the plain walk trains a chunk only when it has loss rows (rows >= n_prefix - 1)
            steps += [("backward" if p + size > n_prefix - 1 else "forward", size)
                      for p, size in zip(range(0, n, chunk), _chunks(0, n, chunk), strict=True)]
    return steps


def predicted_ms(steps: Iterable[tuple[str, int]], cost: StepCost = DEFAULT_COST) -> float:
    return sum(cost.step_ms(kind, n) for kind, n in steps)


def prefer_group(n_prefix: int, reply_lengths: Sequence[int], chunk: int, exact: bool,
                 cost: StepCost = DEFAULT_COST) -> bool:
    """True when the group walk is predicted faster than separate windows (never for one reply)."""
    if len(reply_lengths) < 2:
        return False
    return predicted_ms(group_steps(n_prefix, reply_lengths, chunk), cost) < \
        predicted_ms(separate_steps(n_prefix, reply_lengths, chunk, exact), cost)


def fit_cost(steps: Iterable[dict]) -> StepCost:
    """Least squares of ms on tokens, per pass, over receipts' {"pass", "tokens", "ms"}."""
    out = []
    for kind in ("forward", "backward"):
        rows = [(s["tokens"], s["ms"]) for s in steps if s["pass"] == kind]
        if len(rows) < 2:
            raise ValueError(f"fit_cost needs at least two {kind} steps, got {len(rows)}")
        x, y = np.array(rows, dtype=np.float64).T
        if x.max() < 2 * x.min():
            # one size of step: no lever for a fixed cost, so the line goes through 0
            slope, fixed = float(x @ y / (x @ x)), 0.0
        else:
            slope, fixed = np.polyfit(x, y, 1)
        out += [max(float(fixed), 0.0), float(slope)]
    return StepCost(*out)


# -- rendered groups ---------------------------------------------------------------
@dataclass(frozen=True)
class TrainGroup:
    """One prompt and its weighted replies, ready for `Trainer.begin_group`.

    `prefix` holds no loss token; reply g is `replies[g] = (tokens, mask, weight)`
    with the mask convention of TrainWindow (mask[i] trains the prediction of
    tokens[i]; a reply's first token is predicted from the prefix's last).
    `share_prefix` is the cost model's pick (prefer_group) for the job's chunk."""

    prefix: tuple[int, ...]
    replies: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...]
    source: int = 0
    label: str = ""
    share_prefix: bool = True

    def __len__(self) -> int:
        """Tokens the group holds (prompt once, every reply)."""
        return len(self.prefix) + sum(len(t) for t, _, _ in self.replies)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt once, then every reply (what the group holds in memory; limits count these)."""
        return self.prefix + tuple(t for toks, _, _ in self.replies for t in toks)

    @property
    def n_targets(self) -> int:
        return sum(sum(m) for _, m, _ in self.replies)

    @property
    def longest(self) -> int:
        """Tokens of the longest window (prompt + reply): what the training cache must hold."""
        return len(self.prefix) + max(len(t) for t, _, _ in self.replies)

    def structure(self) -> dict:
        """What a receipt says about the group: prompt tokens, G, reply tokens, weights, the path."""
        return {"label": self.label, "prefix_tokens": len(self.prefix), "G": len(self.replies),
                "reply_tokens": [len(t) for t, _, _ in self.replies], "weights": [w for _, _, w in self.replies],
                "shared_prefix": self.share_prefix}

    def windows(self) -> list:
        """The G separate windows (prompt + reply), e.g. for held-out loss."""
        return [TrainWindow(self.prefix + t, (0,) * len(self.prefix) + m, self.source, self.label)
                for t, m, _ in self.replies]


def assemble_group(windows: Sequence, weights: Sequence[float], chunk: int, source: int = 0,
                   label: str = "") -> TrainGroup:
    """A group from G rendered windows of one prompt: the prefix is their common
    first tokens up to the first trained one (so it carries no loss)."""
    if not windows or len(windows) != len(weights):
        raise ValueError(f"a group needs one weight per window, got {len(windows)} windows, {len(weights)} weights")
    first = min(m.index(1) if 1 in m else len(m) for m in (tuple(w.mask) for w in windows))
    toks = [tuple(w.tokens) for w in windows]
    p = 0
    while p < first and all(len(t) > p and t[p] == toks[0][p] for t in toks):
        p += 1
    if p < 1:
        raise ValueError(f"{label or 'group'}: the windows share no first token")
    replies = tuple((t[p:], tuple(w.mask)[p:], float(wt)) for t, w, wt in zip(toks, windows, weights, strict=True))
    lens = [len(t) for t, _, _ in replies]
    return TrainGroup(toks[0][:p], replies, source, label, prefer_group(p, lens, chunk, exact=True))


def group_by_prefix(windows: Sequence, chunk: int, min_prefix: int = 2) -> list:
    """Plain windows whose rendered prefix (the tokens before their first trained
    token) is the same, at least `min_prefix` long, become one group of unit
    weights (in first-seen order); the others, and groups, stay as they are."""
    by_key: dict[tuple, list[int]] = {}
    for i, w in enumerate(windows):
        if isinstance(w, TrainGroup):
            continue            # already a group: passes through
        mask = tuple(w.mask)
        first = mask.index(1) if 1 in mask else len(mask)
        if first >= min_prefix:
            by_key.setdefault(tuple(w.tokens[:first]), []).append(i)
    grouped = {idx[0]: idx for idx in by_key.values() if len(idx) > 1}
    members = {i for idx in grouped.values() for i in idx}
    out = []
    for i, w in enumerate(windows):
        if i in grouped:
            idx = grouped[i]
            labels = sorted({windows[j].label for j in idx})
            out.append(assemble_group([windows[j] for j in idx], [1.0] * len(idx), chunk, w.source,
                                      labels[0] if len(labels) == 1
                                      else f"{labels[0]} + {len(idx) - 1} sharing its prompt"))
        elif i not in members:
            out.append(w)
    return out
