"""The anchors' records decoded as parallel sequences in one batch equal the one-by-one records."""
from __future__ import annotations

import numpy as np
import pytest
from drift_steps import run_steps

from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.records import prompt_tokens, record_many_units, record_units


@pytest.fixture(scope="module")
def four_slots():
    """The default model with 4 sequences, one thread (serving's layout: one K/V stream each)."""
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(n_ctx=2048, n_seq=4, n_threads=1))
    yield m
    m.close()


def test_the_batched_record_equals_the_serial_one(four_slots):
    """Greedy: the answers decoded together (one batch per answer token, one sequence
    each) are the tokens each anchor's own decode gives, and so are the records made
    of them; with samples too."""
    m = four_slots
    prompts = [*load_anchors()[:3], rehearsal_anchors()[0]]
    toks = [prompt_tokens(m, p) for p in prompts]
    many = run_steps(record_many_units(m, [3, 1, 2, 0], prompts, toks, samples=2))
    for prompt, t, got in zip(prompts, toks, many, strict=True):
        one = run_steps(record_units(m, 0, prompt, t, samples=2))
        assert got.continuation == one.continuation and got.answer == one.answer and got.forced == one.forced
        assert np.array_equal(got.top_ids, one.top_ids) and np.array_equal(got.top_logp, one.top_logp)
        assert got.samples == one.samples
    # the answers end at different lengths; each sequence is cleared when they are done
    assert len({len(b.continuation) for b in many}) > 1
    for s in range(4):
        assert m.lc.llama_memory_seq_pos_max(m.memory, s) == -1


def test_a_batch_needs_one_distinct_sequence_per_prompt(four_slots):
    toks = [prompt_tokens(four_slots, p) for p in load_anchors()[:2]]
    with pytest.raises(ValueError, match="one distinct sequence per prompt"):
        run_steps(record_many_units(four_slots, [1, 1], ["a", "b"], toks))
