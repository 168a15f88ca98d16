"""Running the drift package's step generators straight through, for tests and
benchmarks (bench/ puts tests/ on sys.path to import this)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dreamstage.training.drift.decoding import Decoder


def run_steps(gen: Iterator[None]) -> Any:
    """Run a step generator to its end; returns its value."""
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def decoded(resident, seq_id: int, units: Callable[[Decoder], Iterator[None]]) -> Any:
    """`units(decoder)` (one of a Decoder's *_units) run straight through on `seq_id`; its result."""
    dec = Decoder(resident, seq_id)
    try:
        return run_steps(units(dec))
    finally:
        dec.clear()
        dec.close()


def forced_logits(resident, seq_id: int, tokens: Sequence[int], first_row: int) -> np.ndarray:
    """Logits of rows first_row .. len(tokens)-1 of a teacher-forced decode (Decoder.forced_units)."""
    return decoded(resident, seq_id, lambda d: d.forced_units(tokens, first_row))


def greedy_answer(resident, seq_id: int, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The greedy answer, end-of-generation token included (Decoder.greedy_units)."""
    return decoded(resident, seq_id, lambda d: d.greedy_units(prompt, max_tokens))
