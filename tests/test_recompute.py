"""recompute: the layers' activations rematerialized in the backward.

Same gradient (the reference is the same walk without recompute: recompute
changes no arithmetic, so equality is the claim), and a lower graph_mib as
the allocator plans it. Numbers print with `pytest -s` (`[recompute] ...`).
"""
from __future__ import annotations

import numpy as np
import pytest
from test_exact_walk import TEXT, rel_l2  # the shared window text
from test_oracle import _with_random_b


def report(msg: str) -> None:
    print(f"[recompute] {msg}")


def _grad(resident, tokens, mask, *, chunk, recompute, exact=False, lora=None):
    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer
    with Trainer(resident, lora or LoraConfig(rank=2, alpha=4.0, targets=("attn_q", "attn_k", "attn_v", "attn_output",
                                                                           "ffn_gate", "ffn_up", "ffn_down"), seed=11),
                 cache_type="f32", window=len(tokens), chunk=chunk, exact=exact, recompute=recompute,
                 optimizer=OptimizerConfig(lr=0.0)) as tr:
        _with_random_b(tr, std=0.02 if lora else 0.1)
        receipts = tr.train_window(tokens, mask)
        assert all(r.ok for r in receipts), [r.message for r in receipts if not r.ok]
        assert all(r.recompute == recompute for r in receipts)
        return tr.gradients(), receipts


@pytest.mark.parametrize("chunk, exact", [(48, False), (16, False), (12, True)],
                         ids=["one-chunk", "plain-3-chunks", "exact-4-chunks"])
def test_recompute_gives_the_same_gradient_on_the_tiny_model(tiny_resident, chunk, exact):
    tokens = tiny_resident.tokenize(TEXT)[:48]
    mask = np.ones(48, np.uint8)
    mask[:10] = 0
    g_off, r_off = _grad(tiny_resident, tokens, mask, chunk=chunk, exact=exact, recompute=False)
    g_on, r_on = _grad(tiny_resident, tokens, mask, chunk=chunk, exact=exact, recompute=True)
    err = rel_l2(g_on, g_off)
    peak = lambda rs: max(r.graph_mib for r in rs if r.walk_pass == "backward")  # noqa: E731
    report(f"tiny model, chunk {chunk}, exact {exact}: gradient rel L2 {err:.1e}; "
           f"graph_mib {peak(r_off):.2f} -> {peak(r_on):.2f}")
    assert np.count_nonzero(g_on) == g_on.size
    assert err <= 1e-6
    assert peak(r_on) <= peak(r_off)


def test_recompute_halves_graph_mib_at_chunk_256_on_the_default_model(dream_resident):
    """The default model, one chunk of 256 tokens, rank 8 on attn_q, attn_v."""
    from dreamstage.training.walk.trainer import LoraConfig
    tokens = dream_resident.tokenize(TEXT * 8)[:256]
    assert len(tokens) == 256
    mask = np.ones(256, np.uint8)
    g_off, (r_off,) = _grad(dream_resident, tokens, mask, chunk=256, recompute=False, lora=LoraConfig(seed=3))
    g_on, (r_on,) = _grad(dream_resident, tokens, mask, chunk=256, recompute=True, lora=LoraConfig(seed=3))
    err = rel_l2(g_on, g_off)
    report(f"default model, chunk 256: graph_mib {r_off.graph_mib:.1f} -> {r_on.graph_mib:.1f} "
           f"({r_off.graph_mib / r_on.graph_mib:.2f}x); gradient rel L2 {err:.1e}; ms {r_off.ms:.0f} -> {r_on.ms:.0f}")
    assert err <= 1e-6
    assert r_off.graph_mib >= 2 * r_on.graph_mib


def test_recompute_lowers_graph_mib_with_the_same_gradient_on_the_default_model(dream_resident):
    """What holds today at chunk 128: the same gradient, a smaller plan."""
    from dreamstage.training.walk.trainer import LoraConfig
    tokens = dream_resident.tokenize(TEXT * 4)[:128]
    mask = np.ones(128, np.uint8)
    g_off, (r_off,) = _grad(dream_resident, tokens, mask, chunk=128, recompute=False, lora=LoraConfig(seed=3))
    g_on, (r_on,) = _grad(dream_resident, tokens, mask, chunk=128, recompute=True, lora=LoraConfig(seed=3))
    report(f"default model, chunk 128: graph_mib {r_off.graph_mib:.1f} -> {r_on.graph_mib:.1f} "
           f"({r_off.graph_mib / r_on.graph_mib:.2f}x); gradient rel L2 {rel_l2(g_on, g_off):.1e}")
    assert rel_l2(g_on, g_off) <= 1e-6
    assert r_on.graph_mib < r_off.graph_mib
