"""The dream stage's micro-step on the default model's resident context."""
from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from trainer_testing import ProbedTrainer as Trainer

from dreamstage.training.walk.receipts import RECEIPT_FIELDS, Receipt
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig

TEXT = "The dream stage trains a small adapter between decode batches, on the same context. "


@pytest.fixture
def rm(dream_resident):
    return dream_resident


def _example(rm, n=40):
    toks = rm.tokenize(TEXT * 4)[:n]
    mask = np.ones(len(toks), np.uint8)
    return toks, mask


def _cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_loss_on_a_repeated_example_halves_within_30_steps(rm, record_result):
    toks, mask = _example(rm, 32)
    with Trainer(rm, LoraConfig(rank=8, alpha=16, top_layers=4, seed=1), cache_type="q8_0", window=32, chunk=32,
                 optimizer=OptimizerConfig(lr=3e-3, grad_clip=1.0)) as tr:
        losses = []
        for _ in range(30):
            recs = tr.train_window(toks, mask)
            assert [r.status for r in recs] == ["ok"]
            losses.append(Trainer.window_loss(recs))
            if losses[-1] < losses[0] / 2:
                break
    assert losses[-1] < losses[0] / 2, losses
    record_result("loss_halves", {"losses": losses, "steps": len(losses)})


def test_receipt_fields_and_json(rm):
    toks, mask = _example(rm, 24)
    with Trainer(rm, LoraConfig(top_layers=2), cache_type="q4_0", window=32, chunk=16) as tr:
        recs = tr.train_window(toks, mask)
    assert [(r.chunk_pos, r.chunk_tokens) for r in recs] == [(0, 16), (16, 8)]
    # the last token has nothing to predict: 23 loss tokens over two chunks
    assert [r.tokens for r in recs] == [16, 7]
    for r in recs:
        assert r.status == "ok" and r.message == ""
        assert r.window == 32 and r.chunk == 16 and r.context_cache_type == "q4_0"
        assert not r.exact and not r.recompute and r.horizon == -1 and r.walk_pass == "backward" and r.walk_mib == 0
        assert r.loss > 0 and r.ms > 0 and r.graph_mib > 0 and r.context_mib > 0 and r.adapter_mib > 0
        assert r.refused_chunk_pos == -1
        d = json.loads(r.to_json())
        assert tuple(d) == RECEIPT_FIELDS and Receipt(**d) == r   # JSON round trip, every field, in order
        assert r.group_reply == -1
    assert recs[1].step == recs[0].step + 1
    assert recs[1].optimizer_mib > 0


def test_f32_cache_chunked_loss_equals_one_chunk(rm, record_result):
    toks, mask = _example(rm, 48)
    mask[:10] = 0  # an unlabelled prompt part
    cfg = LoraConfig(rank=4, alpha=8, targets="attn_q,attn_k,attn_v", top_layers=3, seed=3)
    opt = OptimizerConfig(lr=0.0)
    rng = np.random.default_rng(0)
    with Trainer(rm, cfg, cache_type="f32", window=48, chunk=48, optimizer=opt) as one:
        theta = one.lora_parameters()
        # a nonzero B so that every LoRA factor has a gradient
        theta = theta + (theta == 0) * rng.normal(0, 0.02, theta.shape)
        one.set_lora_parameters(theta)
        r1 = one.train_window(toks, mask)
        g1 = one.gradients()
    with Trainer(rm, cfg, cache_type="f32", window=48, chunk=16, optimizer=opt) as chunked:
        chunked.set_lora_parameters(theta)
        r3 = chunked.train_window(toks, mask)
        g3 = chunked.gradients()
    assert len(r1) == 1 and len(r3) == 3 and all(r.ok for r in r1 + r3)
    assert r3[0].tokens == 7  # inputs 0..15 predict tokens 1..16, of which 10..16 carry loss
    l1, l3 = Trainer.window_loss(r1), Trainer.window_loss(r3)
    assert abs(l1 - l3) <= 1e-5, (l1, l3)
    cos = _cos(g1, g3)
    # the plain walk drops the gradient through earlier chunks' K/V, so it differs, but not wildly
    assert 0.3 < cos < 1.0 - 1e-6, cos
    record_result("plain_walk_vs_one_chunk", {"loss_one_chunk": l1, "loss_chunked": l3, "abs_diff": abs(l1 - l3),
                                        "grad_cosine": cos, "window": 48, "chunk": 16, "cache": "f32",
                                        "targets": "attn_q,attn_k,attn_v", "top_layers": 3})


def test_two_optimizer_steps_have_fresh_gradients(rm):
    toks, mask = _example(rm, 24)
    with Trainer(rm, LoraConfig(top_layers=2), cache_type="f16", window=24, chunk=12,
                 optimizer=OptimizerConfig(lr=0.0)) as tr:
        tr.train_window(toks, mask)
        g1 = tr.gradients()
        tr.train_window(toks, mask)
        g2 = tr.gradients()
    assert np.linalg.norm(g1) > 0
    # lr = 0: same parameters, same data -> the same gradient, not twice it
    np.testing.assert_allclose(g2, g1, rtol=1e-5, atol=1e-9)


def test_a_reused_step_graph_trains_exactly_as_a_fresh_one(rm):
    # Two trainers from the same start: one reuses the last step's allocated
    # graph for a chunk of the same shape, one builds every graph. Windows of
    # two shapes (one chunk each, then two chunks) and different tokens; on the
    # CPU the same graph computes the same floats, so losses, gradients and
    # parameters must agree exactly, and gradients must not pile up across
    # reuses (each optimizer step starts from a zero accumulator).
    toks = rm.tokenize(TEXT * 8)
    windows = [(toks[i:i + 16], np.ones(16, np.uint8)) for i in (0, 5, 11, 17)]
    masked = np.ones(16, np.uint8)
    masked[:6] = 0
    windows += [(toks[3:19], masked), (toks[7:23], masked), (toks[2:26], np.ones(24, np.uint8)), (toks[0:16], masked)]
    cfg = dict(cache_type="q8_0", window=24, chunk=16, optimizer=OptimizerConfig(lr=2e-3))
    with Trainer(rm, LoraConfig(top_layers=3, seed=5), **cfg) as fresh, \
            Trainer(rm, LoraConfig(top_layers=3, seed=5), **cfg) as kept:
        fresh.set_graph_reuse(False)
        kept.set_lora_parameters(fresh.lora_parameters())
        start = kept.lora_parameters()
        for toks_w, mask in windows:
            a, b = fresh.train_window(toks_w, mask), kept.train_window(toks_w, mask)
            assert [r.status for r in a] == [r.status for r in b] == ["ok"] * len(a)
            assert [r.loss for r in a] == [r.loss for r in b]
            assert [r.graph_mib for r in a] == [r.graph_mib for r in b]
            np.testing.assert_array_equal(kept.gradients(), fresh.gradients())
        np.testing.assert_array_equal(kept.lora_parameters(), fresh.lora_parameters())
        assert np.linalg.norm(kept.lora_parameters() - start) > 0      # it did train
        # reused: windows 2-4 (same shape as 1), 6 (as 5); window 7 has two chunks, 8 a new shape
        assert kept.graph_reuses == 4 and fresh.graph_reuses == 0


def test_a_reused_step_graph_is_still_gated(rm):
    # a reused graph allocates nothing new on a device, but the step's host
    # memory still meets the gate: a budget cut below what the job holds
    # refuses the next step with a receipt, and a restored budget trains on
    toks = rm.tokenize(TEXT * 4)[:16]
    mask = np.ones(16, np.uint8)
    with Trainer(rm, LoraConfig(top_layers=2), cache_type="q8_0", window=16, chunk=16) as tr:
        tr.train_window(toks, mask)
        tr.train_window(toks, mask)
        assert tr.graph_reuses == 1
        tr.set_budget(1.0)
        tr.begin_window(toks, mask)
        r = tr.micro_step()
        assert r.status == "refused" and r.refused_chunk_tokens == 16 and r.refused_allowance_mib >= 0.0
        tr.set_budget(0.0)
        (ok,) = tr.train_window(toks, mask)
        assert ok.status == "ok" and tr.graph_reuses == 1   # the refusal dropped the kept graph: built again
        tr.train_window(toks, mask)
        assert tr.graph_reuses == 2


def test_adamw_update_matches_the_reference_formula(rm):
    toks, mask = _example(rm, 20)
    opt = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, grad_clip=0.05)
    with Trainer(rm, LoraConfig(top_layers=1, seed=7), cache_type="q8_0", window=20, chunk=20, optimizer=opt) as tr:
        theta0 = tr.lora_parameters()
        tr.train_window(toks, mask)
        g = tr.gradients()
        theta1 = tr.lora_parameters()
        m, v, t = tr.optimizer_state()
    assert t == 1
    norm = np.linalg.norm(g)
    assert norm > opt.grad_clip  # clipping is exercised
    gc = g * (opt.grad_clip / norm)
    m_ref = (1 - opt.beta1) * gc
    v_ref = (1 - opt.beta2) * gc * gc
    step = (m_ref / (1 - opt.beta1)) / (np.sqrt(v_ref / (1 - opt.beta2)) + opt.eps)
    expect = theta0 * (1 - opt.lr * opt.weight_decay) - opt.lr * step
    np.testing.assert_allclose(m, m_ref, rtol=1e-4, atol=1e-10)
    np.testing.assert_allclose(theta1, expect, rtol=1e-4, atol=1e-6)
    assert np.abs(theta1 - theta0).max() > 1e-3


def test_set_lr_changes_the_next_updates_step_and_not_the_moments(rm):
    """set_lr (the rehearsal-only epochs' decaying step): the second update, taken
    at another lr, matches AdamW's formula at that lr with moments carried over
    from the first; lr 0 moves nothing; a bad value is refused by name."""
    toks, mask = _example(rm, 20)
    opt = OptimizerConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, grad_clip=0.0)
    with Trainer(rm, LoraConfig(top_layers=1, seed=7), cache_type="q8_0", window=20, chunk=20, optimizer=opt) as tr:
        assert tr.lr == opt.lr
        tr.train_window(toks, mask)
        m1, v1, _ = tr.optimizer_state()
        theta1 = tr.lora_parameters()
        tr.set_lr(2.5e-3)
        assert tr.lr == 2.5e-3
        tr.train_window(toks, mask)
        g = tr.gradients()
        theta2 = tr.lora_parameters()
        m2, v2, t = tr.optimizer_state()
        tr.set_lr(0)
        tr.train_window(toks, mask)
        theta3 = tr.lora_parameters()
        for bad in (-1e-3, float("nan"), float("inf"), "1e-3", True):
            with pytest.raises(ValueError, match="lr must be"):
                tr.set_lr(bad)
        assert tr.lr == 0.0
    assert t == 2
    m_ref = opt.beta1 * m1 + (1 - opt.beta1) * g
    v_ref = opt.beta2 * v1 + (1 - opt.beta2) * g * g
    np.testing.assert_allclose(m2, m_ref, rtol=1e-4, atol=1e-10)
    np.testing.assert_allclose(v2, v_ref, rtol=1e-4, atol=1e-14)
    step = (m_ref / (1 - opt.beta1 ** 2)) / (np.sqrt(v_ref / (1 - opt.beta2 ** 2)) + opt.eps)
    np.testing.assert_allclose(theta2, theta1 - 2.5e-3 * step, rtol=1e-4, atol=1e-7)
    assert np.abs(theta2 - theta1).max() > 1e-4
    np.testing.assert_array_equal(theta3, theta2)


def test_unlabelled_window_is_decode_only(rm):
    toks, _ = _example(rm, 24)
    with Trainer(rm, LoraConfig(top_layers=1), window=24, chunk=12) as tr:
        before = tr.lora_parameters()
        recs = tr.train_window(toks, np.zeros(len(toks), np.uint8))
        assert [r.tokens for r in recs] == [0, 0] and all(r.ok and r.loss == 0 for r in recs)
        np.testing.assert_array_equal(tr.lora_parameters(), before)
        assert tr.optimizer_state()[2] == 0


def test_a_plain_walk_horizon_and_bad_values_are_refused_by_name(rm):
    with pytest.raises(ValueError, match="horizon"):
        Trainer(rm, horizon=16)
    with pytest.raises(ValueError, match="'attn_z'"):
        Trainer(rm, LoraConfig(targets="attn_q,attn_z"))
    with pytest.raises(ValueError, match="chunk"):
        Trainer(rm, window=32, chunk=64)


def test_bad_window_input_is_refused_naming_the_value(rm):
    with Trainer(rm, LoraConfig(top_layers=1), window=16, chunk=8) as tr:
        with pytest.raises(ValueError, match="got 40"):
            tr.begin_window(list(range(40)), [1] * 40)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tr.begin_window([1, 2, 10**7], [1, 1, 1])
        r = tr.micro_step()
        assert r.status == "error" and "no window" in r.message


def _decode(rm, tokens, pos0, seq=0):
    lc = rm.lc
    b = lc.llama_batch_init(len(tokens), 0, 1)
    try:
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, i == len(tokens) - 1
            b.seq_id[i][0] = seq
        assert lc.llama_decode(rm.ctx, b) == 0
        logits = lc.llama_get_logits_ith(rm.ctx, len(tokens) - 1)
        return int(np.ctypeslib.as_array(logits, shape=(rm.n_vocab,)).argmax())
    finally:
        lc.llama_batch_free(b)


def _seq_state(rm, seq=0) -> bytes:
    import ctypes
    lc = rm.lc
    size = lc.llama_state_seq_get_size(rm.ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    n = lc.llama_state_seq_get_data(rm.ctx, buf, size, seq)
    return bytes(buf[:n])


def test_serving_is_untouched_by_micro_steps(rm):
    prompt = rm.tokenize("The capital of France is")
    toks, mask = _example(rm, 32)

    def run(train: bool):
        rm.lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)
        out = [_decode(rm, prompt, 0)]
        state = _seq_state(rm)
        if train:
            with Trainer(rm, LoraConfig(top_layers=2), cache_type="q8_0", window=32, chunk=6,
                         optimizer=OptimizerConfig(lr=1e-2)) as tr:
                tr.apply_served()            # serving uses the served adapter (B = 0: no change yet)
                tr.begin_window(toks, mask)
                recs = [tr.micro_step() for _ in range(5)]
                assert all(r.ok for r in recs), [r.message for r in recs]
                tr.train_window(toks, mask)  # and a finished window: the shadow moved
                assert np.abs(tr.lora_parameters()).sum() > 0
                after = _seq_state(rm)
                pos = len(prompt)
                for _ in range(8):
                    out.append(_decode(rm, [out[-1]], pos))
                    pos += 1
        else:
            after = state
            pos = len(prompt)
            for _ in range(8):
                out.append(_decode(rm, [out[-1]], pos))
                pos += 1
        return out, state, after

    ref, _, _ = run(False)
    got, before, after = run(True)
    assert after == before, "serving's K/V cells changed during micro-steps"
    assert got == ref
    rm.lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)


def test_every_target_gets_a_gradient(rm):
    toks, mask = _example(rm, 16)
    cfg = LoraConfig(targets="attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down", top_layers=1)
    with Trainer(rm, cfg, window=16, chunk=8, optimizer=OptimizerConfig(lr=1e-2)) as tr:
        assert all(r.ok for r in tr.train_window(toks, mask))
        g = tr.unflatten(tr.gradients())
    assert len(g) == 7
    for key, (_, gb) in g.items():   # B's gradient is nonzero even with B = 0
        assert np.abs(gb).max() > 0, key


def test_set_chunk_changes_the_next_chunk_and_keeps_the_window(rm):
    # The chunk ladder: after a refusal the scheduler halves the chunk and
    # retries at the same position, so the setter must keep the walk's place.
    toks, mask = _example(rm, 40)
    with Trainer(rm, LoraConfig(top_layers=2), cache_type="f32", window=64, chunk=32,
                 optimizer=OptimizerConfig(lr=1e-3)) as tr:
        tr.begin_window(toks, mask)
        first = tr.micro_step()
        tr.set_chunk(4)
        assert tr.chunks_left == 2
        rest = [tr.micro_step() for _ in range(2)]
        assert [(r.chunk_pos, r.chunk_tokens, r.chunk) for r in [first, *rest]] == [(0, 32, 32), (32, 4, 4), (36, 4, 4)]
        assert all(r.ok for r in rest) and tr.chunks_left == 0
        assert tr.optimizer_state()[2] == 1      # one update, at the window's end
        for bad in (0, 65, 2.5):
            with pytest.raises(ValueError, match="chunk must be an integer"):
                tr.set_chunk(bad)
        assert tr.chunk == 4


def test_accumulated_windows_update_once_with_their_mean(rm):
    toks, mask = _example(rm, 20)
    opt = OptimizerConfig(lr=1e-2, grad_clip=0.0, accumulate_windows=2)
    with Trainer(rm, LoraConfig(top_layers=1, seed=2), window=20, chunk=10, optimizer=opt) as tr:
        theta0 = tr.lora_parameters()
        tr.train_window(toks, mask)
        g1 = tr.gradients()
        assert tr.optimizer_state()[2] == 0
        np.testing.assert_array_equal(tr.lora_parameters(), theta0)   # no update after one window
        tr.train_window(toks, mask)
        g2 = tr.gradients()
        m, v, t = tr.optimizer_state()
    assert t == 1
    np.testing.assert_allclose(g2, 2 * g1, rtol=1e-5, atol=1e-9)      # summed over both windows
    np.testing.assert_allclose(m, (1 - opt.beta1) * g1, rtol=1e-4, atol=1e-10)  # the update saw their mean


def test_accumulate_windows_must_be_positive(rm):
    with pytest.raises(ValueError, match="accumulate_windows must be >= 1, got 0"):
        Trainer(rm, optimizer=OptimizerConfig(accumulate_windows=0))


def _twin_windows(rm):
    """Two overlapping 24-token windows, and a prompt serving decodes between steps."""
    toks = rm.tokenize(TEXT * 8)
    return [(toks[0:24], np.ones(24, np.uint8)), (toks[5:29], np.ones(24, np.uint8))], \
        rm.tokenize("The capital of France is")


@contextlib.contextmanager
def _twin(rm):
    """Two trainers that start from the same parameters (a reference and one under test)."""
    cfg = dict(cache_type="q8_0", window=24, chunk=8, optimizer=OptimizerConfig(lr=2e-3))
    with Trainer(rm, LoraConfig(top_layers=3, seed=5), **cfg) as ref, \
            Trainer(rm, LoraConfig(top_layers=3, seed=5), **cfg) as other:
        other.set_lora_parameters(ref.lora_parameters())
        yield ref, other


def test_a_stopped_step_goes_on_where_it_stopped_and_trains_as_an_unstopped_one(rm):
    # A step past its deadline stops between two segments of its graph (status
    # "stopped"), keeping what it computed, and the next micro-step goes on
    # with it. Against a trainer that never stopped, the same windows give the
    # same losses, gradients and parameters to the last float (CPU): a stop on
    # a window's first chunk, and on a later chunk stopped again and again (a
    # deadline shorter than any segment: one segment per micro-step), so the
    # cells of the chunks before must survive and the partial results too.
    # Serving decodes in between, on the same context.
    windows, prompt = _twin_windows(rm)
    with _twin(rm) as (plain, stopped):
        start = plain.lora_parameters()
        n_stopped = 0
        for toks_w, mask in windows:
            ref = plain.train_window(toks_w, mask)
            stopped.begin_window(toks_w, mask)
            got = []
            for i in range(len(ref)):
                if i in (0, 2):
                    stopped.set_step_deadline(1e-3)      # long past after the first segment
                    while (r := stopped.micro_step()).status == "stopped":
                        assert "deadline" in r.message and r.chunk_pos == ref[i].chunk_pos
                        assert stopped.chunks_left == len(ref) - i   # the walk did not move
                        n_stopped += 1
                        rm.lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)
                        _decode(rm, prompt, 0)           # serving between the parts (asserts it decoded)
                    stopped.set_step_deadline(None)
                    got.append(r)
                else:
                    got.append(stopped.micro_step())
            assert [r.status for r in got] == ["ok"] * len(ref)
            assert stopped.last_step_stoppable and plain.last_step_stoppable   # with or without a deadline
            assert [r.loss for r in got] == [r.loss for r in ref]
            assert [(r.chunk_pos, r.chunk_tokens) for r in got] == [(r.chunk_pos, r.chunk_tokens) for r in ref]
            np.testing.assert_array_equal(stopped.gradients(), plain.gradients())
        np.testing.assert_array_equal(stopped.lora_parameters(), plain.lora_parameters())
        assert np.linalg.norm(plain.lora_parameters() - start) > 0
        assert n_stopped >= 4 + 3      # two stops per window at least, one chunk stopped in many parts
        # a deadline that is never reached changes nothing either
        stopped.set_step_deadline(60_000.0)
        a, b = plain.train_window(*windows[0]), stopped.train_window(*windows[0])
        assert [r.status for r in b] == ["ok"] * len(a) and [r.loss for r in a] == [r.loss for r in b]
        # a stopped step that is not gone on with (a new window) is forgotten: its cells
        # reverted, and the window trains as on a trainer that never stopped
        stopped.set_step_deadline(1e-3)
        stopped.begin_window(*windows[1])
        assert stopped.micro_step().status == "stopped"
        stopped.set_step_deadline(None)
        a, b = plain.train_window(*windows[1]), stopped.train_window(*windows[1])
        assert [r.loss for r in a] == [r.loss for r in b]
        np.testing.assert_array_equal(stopped.lora_parameters(), plain.lora_parameters())
        with pytest.raises(ValueError, match="deadline"):
            stopped.set_step_deadline(float("nan"))
    rm.lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)


def test_an_aborted_step_leaves_no_trace_and_the_chunk_runs_again(rm):
    # A step still computing at its time limit (dream_set_step_abort) is aborted
    # between two graph nodes and undone: against a trainer where it never began,
    # the same windows give the same losses, gradients, optimizer state and
    # parameters to the last float. Aborted: a window's first chunk, a later
    # chunk after an earlier one accumulated its gradient, and a step stopped at
    # the deadline and then aborted while going on (its computed part goes too).
    # Serving decodes in between, on the same context and CPU backend.
    windows, prompt = _twin_windows(rm)
    with _twin(rm) as (plain, aborted):
        n_aborted = 0
        for w, (toks_w, mask) in enumerate(windows):
            ref = plain.train_window(toks_w, mask)
            aborted.begin_window(toks_w, mask)
            got = []
            for i in range(len(ref)):
                if i in (0, 2):
                    if w == 1 and i == 2:                # stopped first, then aborted going on
                        aborted.set_step_deadline(1e-3)
                        assert aborted.micro_step().status == "stopped"
                        aborted.set_step_deadline(None)
                    aborted.set_step_abort(1e-3)         # past after the first graph node
                    r = aborted.micro_step()
                    assert r.status == "aborted", r.message
                    assert (r.chunk_pos, r.chunk_tokens) == (ref[i].chunk_pos, ref[i].chunk_tokens)
                    assert r.aborted_had_ms == pytest.approx(1e-3) and r.aborted_need_ms > r.aborted_had_ms
                    assert "aborted" in r.message and r.loss == 0 and r.step == ref[i].step   # not counted
                    assert aborted.chunks_left == len(ref) - i   # the walk did not move
                    n_aborted += 1
                    aborted.set_step_abort(None)
                    rm.lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)
                    _decode(rm, prompt, 0)               # serving between (asserts it decoded)
                got.append(aborted.micro_step())
            assert [r.status for r in got] == ["ok"] * len(ref)
            assert [r.loss for r in got] == [r.loss for r in ref]
            np.testing.assert_array_equal(aborted.gradients(), plain.gradients())
            for a, b in zip(aborted.optimizer_state(), plain.optimizer_state(), strict=True):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(aborted.lora_parameters(), plain.lora_parameters())
        assert n_aborted == 4
        # a limit that is never reached changes nothing
        aborted.set_step_abort(60_000.0)
        a, b = plain.train_window(*windows[0]), aborted.train_window(*windows[0])
        assert [r.status for r in b] == ["ok"] * len(a) and [r.loss for r in a] == [r.loss for r in b]
        with pytest.raises(ValueError, match="time limit"):
            aborted.set_step_abort(float("inf"))
    rm.lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)


def test_the_exact_walks_reverse_pass_is_never_stopped(rm):
    # The reverse pass adds into the adjoint buffers as it computes, so a stop
    # midway could not be undone: its chunks ignore the deadline and finish,
    # and the window's gradient is the one a walk without a deadline gets.
    # The forward sweep only fills the cache, so it stops and goes on like the
    # plain walk (a graph the walk does not keep: freed when it completes).
    toks = rm.tokenize(TEXT * 8)[:24]
    mask = np.ones(24, np.uint8)
    cfg = dict(cache_type="f32", window=24, chunk=8, exact=True)
    with Trainer(rm, LoraConfig(top_layers=2, seed=3), **cfg) as ref, \
            Trainer(rm, LoraConfig(top_layers=2, seed=3), **cfg) as tr:
        tr.set_lora_parameters(ref.lora_parameters())
        want = ref.train_window(toks, mask)
        tr.begin_window(toks, mask)
        tr.set_step_deadline(1e-3)
        got, stops = [], 0
        while not got or got[-1].walk_pass == "forward":   # the forward sweep stops and goes on
            r = tr.micro_step()
            stops += r.status == "stopped"
            # the forward sweep's graphs can stop; the reverse pass's cannot
            assert tr.last_step_stoppable == (r.walk_pass == "forward")
            if r.status != "stopped":
                got.append(r)
        assert stops >= 2
        tr.set_step_abort(1e-3)                      # nor aborted: undoing it would need the adjoints as they were
        while tr.chunks_left:                        # the reverse pass, same deadline: never stopped
            got.append(tr.micro_step())
            assert not tr.last_step_stoppable        # the pacer then cuts chunks instead (StepShaper.cut)
        reverse = [r for r in got if r.walk_pass == "backward"]
        assert len(reverse) >= 2 and [r.status for r in got] == ["ok"] * len(want)
        assert [r.loss for r in got] == [r.loss for r in want]
        np.testing.assert_array_equal(tr.gradients(), ref.gradients())
        assert np.linalg.norm(ref.gradients()) > 0
