"""The shipped anchor prompts (dreamstage/data/anchors.json): the `measure` half
drift is measured on and the `rehearse` half the regularizer trains on, disjoint.

Standard library only: the request model (jobs/spec.py) reads it to refuse a
job anchor that is a rehearsal one, and nothing here imports back.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources


def _shipped(part: str) -> list[str]:
    text = resources.files("dreamstage").joinpath("data/anchors.json").read_text(encoding="utf-8")
    return list(json.loads(text)[part])


def load_anchors(extra: Iterable[str] = ()) -> list[str]:
    """The anchors drift is measured on: the shipped `measure` half, then
    `extra` (a job's own), without duplicates. The regularizer never trains
    on these (rehearsal_anchors)."""
    out: list[str] = []
    for p in [*_shipped("measure"), *extra]:
        if p not in out:
            out.append(p)
    return out


def rehearsal_anchors() -> list[str]:
    """The anchors the regularizer trains on: the shipped `rehearse` half,
    disjoint from every measured anchor (a job may not name one of these as
    its own anchor: TrainRequest refuses it)."""
    return _shipped("rehearse")
