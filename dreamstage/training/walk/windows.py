"""A training window: token ids plus a per-token loss mask.

The mask convention, used end to end:

    mask[t] == 1  <=>  the loss term  -log p(tokens[t] | tokens[:t])  counts,

i.e. token t is a *target*, predicted by the logits at position t - 1. So
`mask[0]` is always 0 (nothing in the window predicts its first token), and
`TrainWindow.labels()` gives the shifted, per-position form a trainer may
prefer (labels[p] = tokens[p + 1] where that token is a target, else -1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainWindow:
    """One training window: `tokens` with `mask` (see the module docstring)."""

    tokens: tuple[int, ...]
    mask: tuple[int, ...]
    source: int = 0          # the body example it came from
    label: str = ""          # e.g. "examples[2]" or "text"
    # soft targets (ids, probs), each (targets, k): target r is trained against row r's
    # distribution instead of the token itself (Trainer.begin_window's `soft`); None: one-hot
    soft: tuple[Any, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if len(self.tokens) != len(self.mask):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.mask)} mask entries")
        if self.mask and self.mask[0]:
            raise ValueError("mask[0] must be 0: no position predicts a window's first token")
        if self.soft is not None and len(self.soft[0]) != self.n_targets:
            raise ValueError(f"{len(self.soft[0])} soft target rows but {self.n_targets} targets")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_targets(self) -> int:
        return sum(self.mask)

    def labels(self) -> list[int]:
        """Per position p: the token it must predict (tokens[p+1]) or -1."""
        n = len(self.tokens)
        return [self.tokens[p + 1] if p + 1 < n and self.mask[p + 1] else -1 for p in range(n)]

    def chunks(self, chunk: int, start: int = 0) -> list[tuple[int, int]]:
        """(chunk_pos, chunk_tokens) pairs walking the window from `start`."""
        return chunk_spans(len(self.tokens), chunk, start)


def chunk_spans(n_tokens: int, chunk: int, start: int = 0) -> list[tuple[int, int]]:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(p, min(chunk, n_tokens - p)) for p in range(start, n_tokens, chunk)]
