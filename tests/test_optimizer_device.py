"""The optimizer on the adapter's device against the host optimizer.

On a GPU the dream stage keeps the gradient accumulator and AdamW's moments
where the adapter lives and updates it with ggml's OPT_STEP_ADAMW
(dreamstage/ggml_ext/dream-optim.cpp). The same code runs on any ggml backend,
so DREAMSTAGE_OPTIMIZER=device puts it on the CPU backend here, and each test
trains two trainers from the same start, one per optimizer, on the same data:
the host optimizer is the reference (its formula is checked in
test_trainer.py::test_adamw_update_matches_the_reference_formula).
"""
from __future__ import annotations

import numpy as np
import pytest
from trainer_testing import ProbedTrainer as Trainer

from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig

TEXT = "The dream stage trains a small adapter between decode batches, on the same context. "


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _pair(monkeypatch, rm, lora, **cfg):
    host = Trainer(rm, lora, **cfg)
    monkeypatch.setenv("DREAMSTAGE_OPTIMIZER", "device")
    try:
        dev = Trainer(rm, lora, **cfg)
    finally:
        monkeypatch.delenv("DREAMSTAGE_OPTIMIZER")
    dev.set_lora_parameters(host.lora_parameters())
    assert dev.optimizer_on_device and not host.optimizer_on_device
    return host, dev


def _windows(rm):
    toks = rm.tokenize(TEXT * 8)
    masked = np.ones(24, np.uint8)
    masked[:7] = 0
    return [(toks[0:24], np.ones(24, np.uint8)), (toks[5:29], masked), (toks[11:35], np.ones(24, np.uint8)),
            (toks[2:26], masked), (toks[9:33], np.ones(24, np.uint8)), (toks[4:28], masked)]


@pytest.mark.parametrize("exact", [False, True], ids=["plain-walk", "exact-walk"])
def test_device_optimizer_trains_as_the_host_optimizer(monkeypatch, dream_resident, exact):
    rm = dream_resident
    # clipping on (the norm comes back from the device), weight decay, two
    # windows per update (the accumulator sums over windows, then their mean)
    opt = OptimizerConfig(lr=3e-3, beta1=0.85, beta2=0.97, eps=1e-7, weight_decay=0.05, grad_clip=0.5,
                          accumulate_windows=2)
    host, dev = _pair(monkeypatch, rm, LoraConfig(top_layers=2, seed=9, targets="attn_q,attn_v,ffn_down"),
                      cache_type="f32", window=24, chunk=10, exact=exact, optimizer=opt)
    with host, dev:
        start = host.lora_parameters()
        clipped = 0
        for i, (toks, mask) in enumerate(_windows(rm)):
            a, b = host.train_window(toks, mask), dev.train_window(toks, mask)
            assert [r.status for r in a] == [r.status for r in b] == ["ok"] * len(a), [r.message for r in b]
            # a fresh accumulator at each update, the same sum in between
            g_host, g_dev = host.gradients(), dev.gradients()
            assert np.linalg.norm(g_host) > 0
            assert _rel(g_dev, g_host) < 1e-4, i
            clipped += np.linalg.norm(g_host / 2) > opt.grad_clip and i % 2 == 1
            # the same state, plus the device buffers' alignment and the small graphs' intermediates
            assert a[-1].optimizer_mib <= b[-1].optimizer_mib < a[-1].optimizer_mib + 1.0
        m_h, v_h, t_h = host.optimizer_state()
        m_d, v_d, t_d = dev.optimizer_state()
        theta_h, theta_d = host.lora_parameters(), dev.lora_parameters()
    assert t_h == t_d == 3
    assert clipped >= 1                                   # the clip was exercised
    assert _rel(m_d, m_h) < 1e-4 and _rel(v_d, v_h) < 1e-4
    # the parameters moved, and moved the same way
    assert np.linalg.norm(theta_h - start) > 1e-3 * np.linalg.norm(start)
    assert _rel(theta_d - start, theta_h - start) < 1e-4


def test_device_optimizer_in_a_shared_prefix_group(monkeypatch, dream_resident):
    # a group scales the accumulator by G (and back) on the device
    rm = dream_resident
    toks = rm.tokenize(TEXT * 4)
    prompt = toks[:9]
    replies = [(toks[9 + 3 * g:17 + 3 * g], np.ones(8, np.uint8), 1.0 + 0.5 * g) for g in range(3)]
    opt = OptimizerConfig(lr=2e-3, grad_clip=0.0, accumulate_windows=2)
    host, dev = _pair(monkeypatch, rm, LoraConfig(top_layers=1, seed=4), cache_type="f32", window=24, chunk=8,
                      optimizer=opt)
    with host, dev:
        start = host.lora_parameters()
        for tr in (host, dev):
            tr.train_window(toks[:20], np.ones(20, np.uint8))     # a window first: the group's update sums both
            assert all(r.ok for r in tr.train_group(prompt, replies))
        assert _rel(dev.gradients(), host.gradients()) < 1e-4
        assert host.optimizer_state()[2] == dev.optimizer_state()[2] == 1
        d_h, d_d = host.lora_parameters() - start, dev.lora_parameters() - start
    assert np.linalg.norm(d_h) > 0
    assert _rel(d_d, d_h) < 1e-4
