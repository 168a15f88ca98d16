"""The memory gate, the training cache's size per type, and refusals by name."""
from __future__ import annotations

import ctypes
import os
import re
import resource

import numpy as np
import pytest
from trainer_testing import ProbedTrainer as Trainer

from dreamstage import native
from dreamstage.native import dream_h
from dreamstage.training.walk.receipts import DreamError, Receipt
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig


@pytest.fixture
def rm(dream_resident):
    return dream_resident


def _rss_kib() -> int:
    """Resident memory in KiB, after glibc returned its freed heap pages: what
    the planning step frees (the twin graph's metadata) must not count as kept."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_context_mib_orders_by_cache_type(rm, record_result):
    sizes = {}
    for t in ("q4_0", "q8_0", "f16", "f32"):
        with Trainer(rm, LoraConfig(top_layers=1), cache_type=t, window=1024, chunk=64) as tr:
            sizes[t] = tr.init_receipt.context_mib
    assert sizes["q4_0"] < sizes["q8_0"] < sizes["f16"] < sizes["f32"]
    # SmolLM2-135M: 30 layers x (K + V) x 192 values per token
    assert sizes["f32"] == pytest.approx(30 * 2 * 192 * 4 * 1024 / 2**20)
    ratios = {t: sizes[t] / sizes["f32"] for t in sizes}
    record_result("context_mib", {"window": 1024, "context_mib": sizes, "ratio_to_f32": ratios})


def test_unknown_cache_type_is_refused_by_name(rm):
    # the native layer refuses it, before allocating anything (the body's check is test_trainspec's)
    L = native.lib()
    p = L.dream_default_params()
    p.context_cache_type = b"bf16"
    r = dream_h.DreamReceiptC()
    assert not L.dream_init(rm.ctx, p, ctypes.byref(r))
    rec = Receipt.from_c(r)
    assert rec.status == "error" and "'bf16'" in rec.message
    assert rec.message.endswith("is not one of " + L.dream_context_cache_types().decode())   # the one list
    assert rec.context_mib == 0 and rec.adapter_mib == 0


def test_job_that_cannot_hold_its_cache_is_refused_at_start(rm):
    with pytest.raises(DreamError) as e:
        Trainer(rm, LoraConfig(top_layers=1), cache_type="f32", window=4096, chunk=64, budget_mib=4.0, slack_mib=0.0)
    rec = e.value.receipt
    assert rec.status == "refused"
    assert rec.refused_need_mib > rec.refused_allowance_mib
    assert "training cache" in rec.message and "CPU" in rec.message


def test_over_budget_chunk_is_refused_and_changes_nothing(rm):
    toks = rm.tokenize("A refusal must leave the adapter and the optimizer exactly as they were. " * 3)[:48]
    mask = np.ones(len(toks), np.uint8)
    with Trainer(rm, LoraConfig(top_layers=2), cache_type="q8_0", window=48, chunk=16,
                 optimizer=OptimizerConfig(lr=1e-2), budget_mib=4096, slack_mib=0.0) as tr:
        assert all(r.ok for r in tr.train_window(toks, mask))   # optimizer state now exists
        theta, (m, v, t), grads = tr.lora_parameters(), tr.optimizer_state(), tr.gradients()
        held = tr.init_receipt.adapter_mib + tr.init_receipt.context_mib
        tr.set_budget(held + 0.5)          # less than one chunk's graph
        tr.begin_window(toks, mask)
        rss0 = _rss_kib()
        rec = tr.micro_step()
        rss1 = _rss_kib()
        assert rec.status == "refused", rec
        assert rec.refused_need_mib > rec.refused_allowance_mib
        assert rec.refused_chunk_pos == 0 and rec.refused_chunk_tokens == 16
        assert "chunk at 0 (16 tokens)" in rec.message and "allowance" in rec.message
        # the budget is below what the job holds (its graph buffers from the first
        # window): the allowance is 0, not negative, and the message says why
        assert rec.refused_allowance_mib == 0.0
        assert f"the budget ({held + 0.5:.2f} MiB) is below what the job already holds ({tr.held_mib():.2f} MiB)" \
            in rec.message, rec.message
        assert rec.graph_mib > 0
        # the gate's figures per device: here the CPU alone, the refusing one
        (cpu,) = tr.gate_devices()
        assert cpu["device"] == rec.refused_device == "CPU"
        assert cpu["need_mib"] == pytest.approx(rec.refused_need_mib) and cpu["allowance_mib"] == 0.0
        np.testing.assert_array_equal(tr.lora_parameters(), theta)
        m2, v2, t2 = tr.optimizer_state()
        assert t2 == t
        np.testing.assert_array_equal(m2, m)
        np.testing.assert_array_equal(v2, v)
        # the window restarted the gradient (zeros), and the refused chunk added nothing
        assert not tr.gradients().any() and grads.any()
        # nothing was allocated for the refused chunk (its planned graph is several MiB)
        assert (rss1 - rss0) / 1024 < min(1.0, rec.graph_mib / 4), (rss0, rss1, rec.graph_mib)
        assert tr.chunks_left == 3
        # a refused chunk can be retried once the budget allows it
        tr.set_budget(0)
        again = tr.micro_step()
        assert again.status == "ok" and again.chunk_pos == 0
        (cpu,) = tr.gate_devices()
        assert cpu["allowance_mib"] > cpu["need_mib"] >= 0


def test_training_never_touches_serving_compute_buffer():
    """Training graphs run on the stage's own schedulers: a step, a refusal and
    the end of a job leave serving's compute buffer at its own size, and
    serving's output is the same as before the job."""
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    L = native.lib()
    prompt = "The memory gate keeps serving's buffers"
    # a small serving batch, so the training graph is larger than serving's buffer
    with ResidentModel(ResidentConfig(n_ctx=256, n_batch=64, n_seq=1, n_threads=1)) as rm:
        before_text = rm.generate_greedy(prompt, max_tokens=8)
        serving = L.dream_serving_compute_bytes(rm.ctx)
        assert serving > 0
        toks = rm.tokenize("Training graphs are planned on a twin and allocated once. " * 12)[:128]
        mask = np.ones(len(toks), np.uint8)
        with Trainer(rm, LoraConfig(top_layers=2), cache_type="q8_0", window=128, chunk=128,
                     optimizer=OptimizerConfig(lr=1e-3), slack_mib=0.0) as tr:
            recs = tr.train_window(toks, mask)
            assert all(r.ok for r in recs) and recs[0].graph_mib > 0
            # planned or allocated on serving's scheduler, this graph would have grown its buffer
            assert recs[0].graph_mib * 2**20 > serving
            assert L.dream_serving_compute_bytes(rm.ctx) == serving
            assert L.dream_last_n_splits(tr._handle()) == 1   # CPU only: one split
            assert not tr.fused_attention    # explicit attention: the fused backward runs on CUDA only
            assert not tr.optimizer_on_device   # the adapter is in host memory: so is the optimizer
            tr.set_budget(tr.init_receipt.adapter_mib + tr.init_receipt.context_mib + 0.25)
            tr.begin_window(toks, mask)
            assert tr.micro_step().status == "refused"
            assert L.dream_serving_compute_bytes(rm.ctx) == serving
        assert L.dream_serving_compute_bytes(rm.ctx) == serving
        assert rm.generate_greedy(prompt, max_tokens=8) == before_text


def _mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's MemAvailable")
def test_the_cpus_free_memory_is_the_hosts_available_memory_not_its_total(rm):
    """ggml's CPU device reports the host's total as free; the gate reads MemAvailable, so what
    serving and other processes hold counts. A slack above it leaves no allowance, and the
    refusal names the free figure the gate saw."""
    avail = _mem_available_mib()
    with pytest.raises(DreamError) as e:
        Trainer(rm, LoraConfig(top_layers=1), cache_type="q8_0", window=64, chunk=16, slack_mib=avail + 4096)
    rec = e.value.receipt
    assert rec.status == "refused" and rec.refused_allowance_mib == 0.0
    seen = float(re.search(r"free memory \(([0-9.]+) MiB\) is below the slack", rec.message).group(1))
    assert abs(seen - _mem_available_mib()) < max(0.02 * avail, 256), (seen, avail)
