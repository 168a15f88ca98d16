"""The exact walk against the whole-window (one-chunk) gradient.

The reference for a chunked walk is never the chunked walk itself: it is the
one-chunk gradient of the same window (the native graph over the whole window,
which reads no cache), and for the horizon the float64 NumPy reference with
the attention edges older than the horizon detached (tests/numpy_ref.py).
Numbers print with `pytest -s` (lines `[exact] ...`); docs/architecture/oracle.md
quotes them.
"""
from __future__ import annotations

import numpy as np
import numpy_ref as ref
import pytest
from test_oracle import _with_random_b  # the trainer's own A with a random nonzero B

RANK, ALPHA = 2, 4.0
TEXT = ("The dream stage trains a LoRA adapter between decode batches, on the same llama context that serves. "
        "Long conversations are where the exact walk matters: every chunk's loss reaches the K/V of the chunks "
        "before it, and the whole-window gradient is what the conversation says.")
WINDOW = 48


def rel_l2(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def cosine(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


def report(msg: str) -> None:
    print(f"[exact] {msg}")


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_path):
    return ref.LlamaRef.from_gguf(tiny_model_path)


def _window(resident, context: int):
    """48 tokens; the first `context` are read but not trained on (a system prompt)."""
    tokens = resident.tokenize(TEXT)[:WINDOW]
    assert len(tokens) == WINDOW
    mask = np.ones(WINDOW, np.uint8)
    mask[:context] = 0
    return tokens, mask


def _trainer(resident, *, chunk, exact=False, horizon=-1, cache_type="f32", lr=0.0, window=WINDOW, budget_mib=0.0):
    from trainer_testing import ProbedTrainer as Trainer

    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig
    # eps = 1: the first AdamW step is then about -lr * g / (|g| + 1), a smooth
    # function of g, so equal gradients must give equal updates (with a tiny
    # eps the step is lr * sign(g) and says nothing about the gradient's size)
    return Trainer(resident, LoraConfig(rank=RANK, alpha=ALPHA, targets=ref.TARGETS, seed=11),
                   cache_type=cache_type, window=window, chunk=chunk, exact=exact, horizon=horizon,
                   budget_mib=budget_mib, optimizer=OptimizerConfig(lr=lr, eps=1.0, grad_clip=0.0))


def _run(resident, tokens, mask, **kw):
    """One window: (gradient, update, window loss, receipts)."""
    with _trainer(resident, lr=1e-2, **kw) as tr:
        theta = _with_random_b(tr)
        receipts = tr.train_window(tokens, mask)
        assert all(r.ok for r in receipts), [r.message for r in receipts if not r.ok]
        return tr.gradients(), tr.lora_parameters() - theta, tr.window_loss(receipts), receipts, theta, tr


@pytest.fixture(scope="module")
def one_chunk(tiny_resident):
    """The whole-window gradient per context length: one chunk, no cache read."""
    out = {}
    for context in (0, 20):
        tokens, mask = _window(tiny_resident, context)
        g, upd, loss, receipts, theta, _ = _run(tiny_resident, tokens, mask, chunk=WINDOW)
        assert [r.chunk_tokens for r in receipts] == [WINDOW]
        out[context] = (g, upd, loss, theta)
    return out


@pytest.mark.parametrize("context", [0, 20], ids=["all-labelled", "unlabelled-context-20"])
@pytest.mark.parametrize("n_chunks", [2, 4, 8])
def test_exact_walk_equals_the_one_chunk_gradient(tiny_resident, one_chunk, n_chunks, context):
    tokens, mask = _window(tiny_resident, context)
    chunk = WINDOW // n_chunks
    g, upd, loss, receipts, theta, tr = _run(tiny_resident, tokens, mask, chunk=chunk, exact=True)
    g1, upd1, loss1, theta1 = one_chunk[context]
    assert np.array_equal(theta, theta1)
    # the forward sweep fills the cache up to the last chunk, which then runs
    # forward and backward; the reverse pass walks back to position 0
    last = ((WINDOW - 2) // chunk) * chunk
    passes = [(r.walk_pass, r.chunk_pos) for r in receipts]
    assert passes == [("forward", p) for p in range(0, last, chunk)] + \
                     [("backward", p) for p in range(last, -1, -chunk)]
    assert all(r.exact and r.horizon == 0 for r in receipts)
    # the adjoint buffers exist from the first backward chunk on: the whole window, F32 K and V rows
    assert {r.walk_mib for r in receipts if r.walk_pass == "backward"} == {WINDOW * 2 * 2 * 32 * 4 / 2**20}
    err, err_upd = rel_l2(g, g1), rel_l2(upd, upd1)
    report(f"f32 cache, {n_chunks} chunks of {chunk}, {context} unlabelled in front: gradient rel L2 {err:.2e} "
           f"(cosine {cosine(g, g1):.8f}), update rel L2 {err_upd:.2e}, loss |d| {abs(loss - loss1):.1e}, "
           f"walk_mib {receipts[-1].walk_mib:.4f}")
    assert abs(loss - loss1) <= 1e-5 * loss1
    assert err <= 1e-5
    assert np.count_nonzero(upd) == upd.size and np.count_nonzero(upd1) == upd1.size
    assert err_upd <= 1e-5


@pytest.mark.parametrize("chunks", [(7,), (5,), (13,), (16, 8, 8, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3)],
                         ids=["ragged-7", "ragged-5", "ragged-13", "ladder-16-8-3"])
def test_exact_walk_is_exact_for_any_chunking(tiny_resident, one_chunk, chunks):
    """Chunks that do not divide the window, and a chunk that shrinks while
    the window is walked (the ladder after refusals: set_chunk between
    micro-steps, here in the forward sweep and in the reverse pass)."""
    tokens, mask = _window(tiny_resident, 20)
    g1 = one_chunk[20][0]
    with _trainer(tiny_resident, chunk=chunks[0], exact=True) as tr:
        _with_random_b(tr)
        tr.begin_window(tokens, mask)
        receipts = []
        while tr.chunks_left:
            k = chunks[min(len(receipts), len(chunks) - 1)]
            if k != tr.chunk:
                tr.set_chunk(k)
            receipts.append(tr.micro_step())
            assert receipts[-1].ok, receipts[-1].message
        g = tr.gradients()
    err = rel_l2(g, g1)
    report(f"chunks {chunks[0]}" + (f" shrinking to {chunks[-1]}" if len(chunks) > 1 else "") +
           f": {len(receipts)} micro-steps, gradient vs one chunk rel L2 {err:.2e}")
    assert any(r.walk_pass == "backward" and r.chunk_pos > 0 for r in receipts)
    assert err <= 1e-5


def test_a_refused_reverse_chunk_retried_smaller_refills_the_cache(tiny_resident, one_chunk):
    """A reverse-pass chunk gives up its own cache cells when it starts; refused
    there and retried with a smaller chunk, the walk first re-runs forward the
    cells the smaller chunk now reads, and the gradient stays exact."""
    tokens, mask = _window(tiny_resident, 20)
    with _trainer(tiny_resident, chunk=12, exact=True) as tr:
        _with_random_b(tr)
        tr.begin_window(tokens, mask)
        first = [tr.micro_step() for _ in range(4)]       # 3 forward, then the backward chunk at 36
        assert [(r.walk_pass, r.chunk_pos) for r in first][-1] == ("backward", 36) and all(r.ok for r in first)
        tr.set_budget(1e-3)
        refused = tr.micro_step()
        assert refused.status == "refused" and refused.chunk_pos == 24 and "horizon halved" in refused.message
        assert tr.set_horizon(0) == 0
        tr.set_budget(0.0)
        tr.set_chunk(6)
        rest = []
        while tr.chunks_left:
            rest.append(tr.micro_step())
            assert rest[-1].ok, rest[-1].message
        g = tr.gradients()
    assert [(r.walk_pass, r.chunk_pos) for r in rest][:2] == [("forward", 24), ("backward", 30)]
    err = rel_l2(g, one_chunk[20][0])
    report(f"reverse chunk refused at 24, retried with chunk 6 after a refill: gradient vs one chunk rel L2 {err:.2e}")
    assert err <= 1e-5


def test_exact_walk_matches_the_float64_reference(tiny_resident, tiny_ref):
    """The same claim against the independent NumPy gradient of the whole window."""
    tokens, mask = _window(tiny_resident, 20)
    g, _, _, _, theta, tr = _run(tiny_resident, tokens, mask, chunk=6, exact=True)
    lora = ref.Lora(scale=ALPHA / RANK, factors={k: (a.copy(), b.copy()) for k, (a, b) in tr.unflatten(theta).items()})
    _, full = ref.loss_and_grad(tiny_ref, tokens, ref.positions_from_mask(mask), lora)
    err = rel_l2(g, ref.flat_grad(full, tr.parameter_order()))
    report(f"exact walk, 8 chunks of 6, vs float64 reference: rel L2 {err:.2e}")
    assert err <= 1e-4   # the oracle's float32-vs-float64 bound (test_oracle.py)


@pytest.mark.parametrize("horizon", [6, 12, 18])
def test_horizon_equals_the_detached_reference(tiny_resident, tiny_ref, horizon):
    """Only the last H positions before a chunk receive its gradient: the
    reference is the whole window with the older attention edges detached."""
    tokens, mask = _window(tiny_resident, 0)
    chunk = 6
    g, _, _, receipts, theta, tr = _run(tiny_resident, tokens, mask, chunk=chunk, exact=True, horizon=horizon)
    assert {r.horizon for r in receipts} == {horizon}
    lora = ref.Lora(scale=ALPHA / RANK, factors={k: (a.copy(), b.copy()) for k, (a, b) in tr.unflatten(theta).items()})
    lp = ref.positions_from_mask(mask)
    order = tr.parameter_order()
    _, hz = ref.horizon_walk_grad(tiny_ref, tokens, lp, lora, chunk, horizon)
    _, full = ref.loss_and_grad(tiny_ref, tokens, lp, lora)
    g_h, g_full = ref.flat_grad(hz, order), ref.flat_grad(full, order)
    err = rel_l2(g, g_h)
    report(f"horizon {horizon} (chunk {chunk}): vs detached reference rel L2 {err:.2e}; "
           f"the reference's cosine to the whole-window gradient {cosine(g_h, g_full):.6f}")
    assert err <= 1e-4
    assert rel_l2(g_h, g_full) > 1e-3   # the horizon is visible: this is not the whole-window gradient


def test_exact_walk_cache_types_against_the_one_chunk_gradient(tiny_resident, one_chunk):
    """Quantized training caches: the prefix the later chunks read is rounded,
    so the gradient is close, not equal. The plain walk's cosine is beside."""
    tokens, mask = _window(tiny_resident, 20)
    g1 = one_chunk[20][0]
    chunk = 12
    found = {}
    for cache in ("f32", "f16", "q8_0", "q4_0"):
        found[cache] = cosine(_run(tiny_resident, tokens, mask, chunk=chunk, exact=True, cache_type=cache)[0], g1)
        found["plain " + cache] = cosine(_run(tiny_resident, tokens, mask, chunk=chunk, cache_type=cache)[0], g1)
    report("cosine to the one-chunk gradient, 4 chunks of 12, 20 unlabelled in front: " +
           ", ".join(f"{k} {v:.6f}" for k, v in found.items()))
    assert found["f32"] >= 1 - 1e-9
    assert found["f16"] >= 0.999
    assert found["q8_0"] >= 0.99
    assert found["plain f32"] < 0.999   # the plain walk's cut is visible


def test_exact_walk_refuses_nothing_by_name_and_plain_walk_horizon_is_refused(tiny_resident):
    with pytest.raises(ValueError, match="horizon"):
        _trainer(tiny_resident, chunk=8, horizon=16)
    with _trainer(tiny_resident, chunk=8, exact=True, horizon=16) as tr:
        assert tr.init_receipt.walk_mib == 0 and tr.init_receipt.horizon == 16   # allocated at the first backward chunk
        assert tr.set_horizon(0) == 0
    with _trainer(tiny_resident, chunk=8) as tr:
        assert tr.init_receipt.walk_mib == 0 and tr.init_receipt.horizon == -1
        with pytest.raises(ValueError, match="exact walk only"):
            tr.set_horizon(8)


def test_horizon_adjoint_slots_and_a_refusal_halves_the_horizon(tiny_resident, tiny_ref):
    """With a horizon the adjoint buffers hold H + chunk positions (slots reused
    around a ring). A budget that fits the buffers for H/2 but not for H: the
    first backward chunk is refused, H halves, the chunk retries and the window
    completes with the H/2 gradient (against the detached reference).

    97 tokens in chunks of 6: the first backward chunk [90, 96) has the most
    loss rows, so no later chunk needs more host memory than it did. H = 72
    against 36 is 36 adjoint rows (18 KiB on this model): room enough for the
    graphs' plans to differ by a few KiB with H."""
    n = 2 * WINDOW + 1
    tokens = tiny_resident.tokenize(TEXT * 2)[:n]
    mask = np.ones(n, np.uint8)
    chunk, horizon = 6, 72
    row = 2 * 2 * 32 * 4 / 2**20          # K and V rows of both layers, F32
    g_h, _, _, receipts, _, _ = _run(tiny_resident, tokens, mask, chunk=chunk, exact=True, horizon=horizon, window=n)
    assert {r.walk_mib for r in receipts if r.walk_pass == "backward"} == {(horizon + chunk) * row}
    with _trainer(tiny_resident, chunk=chunk, exact=True, horizon=horizon, lr=1e-2, window=n) as tr:
        theta = _with_random_b(tr)
        tr.begin_window(tokens, mask)
        got = [tr.micro_step() for _ in range((n - 2) // chunk)]
        assert [r.walk_pass for r in got] == ["forward"] * len(got) and all(r.ok for r in got)
        # measure the need in two refusals (each halves H; undone): a budget
        # below what the job holds stops at the adjoint buffers' own gate
        # (buffers + the step's host memory), one just above that at the
        # graph's gate (the graph's plan + host memory, the buffers held)
        tr.set_budget(1e-3)
        held_plus_slack = tr.held_mib() + tr.slack_mib
        first = tr.micro_step()
        assert first.status == "refused" and first.message.startswith("the exact walk's adjoint buffers")
        # a budget below what the job holds: the allowance is 0, and the message says why
        assert first.refused_allowance_mib == 0.0
        assert "the budget (0.00 MiB) is below what the job already holds" in first.message
        assert tr.set_horizon(horizon) == horizon
        tr.set_budget(held_plus_slack + first.refused_need_mib + 1e-4)
        second = tr.micro_step()
        assert second.status == "refused" and second.message.startswith(f"chunk at {first.chunk_pos}")
        assert "adjoint buffers for it" in second.message and tr.set_horizon(horizon) == horizon
        walk = {h: (h + chunk) * row for h in (horizon, horizon // 2)}
        need = {h: second.refused_need_mib + walk[h] for h in walk}   # the graph's need changes little with H
        # room for the buffers of H/2 and the graph (and 60% of the difference
        # to H's buffers to spare), not for the buffers of H and the graph
        tr.set_budget(held_plus_slack + second.refused_need_mib + walk[horizon // 2] +
                      0.6 * (walk[horizon] - walk[horizon // 2]))
        refused = tr.micro_step()
        assert refused.status == "refused" and refused.horizon == horizon // 2
        assert f"horizon halved from {horizon} to {horizon // 2}" in refused.message
        rest = []
        while tr.chunks_left:
            rest.append(tr.micro_step())
            assert rest[-1].ok, rest[-1].message
        assert {r.horizon for r in rest} == {horizon // 2}
        assert {r.walk_mib for r in rest} == {(horizon // 2 + chunk) * row}
        g_half = tr.gradients()
        order = tr.parameter_order()
        lora = ref.Lora(scale=ALPHA / RANK,
                        factors={k: (a.copy(), b.copy()) for k, (a, b) in tr.unflatten(theta).items()})
    _, hz = ref.horizon_walk_grad(tiny_ref, tokens, ref.positions_from_mask(mask), lora, chunk, horizon // 2)
    err = rel_l2(g_half, ref.flat_grad(hz, order))
    report(f"budget fits H/2 only: refused at H={horizon} (need about {need[horizon]:.4f} MiB, at H/2 "
           f"{need[horizon // 2]:.4f}), completed with H={horizon // 2}: "
           f"vs detached reference rel L2 {err:.2e}")
    assert err <= 1e-4
    assert rel_l2(g_half, g_h) > 1e-3      # a different horizon, a different gradient


def test_default_model_exact_walk_equals_the_one_chunk_gradient(dream_resident):
    """The default model (SmolLM2-135M Q4_1), 64 tokens with 16 unlabelled in
    front, rank 8 on attn_q, attn_v: the exact walk over 2 and 4 chunks against
    the one-chunk gradient; q8_0 and the plain walk reported beside."""
    from trainer_testing import ProbedTrainer as Trainer

    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig
    n = 64
    tokens = dream_resident.tokenize(TEXT * 2)[:n]
    mask = np.ones(n, np.uint8)
    mask[:16] = 0

    def grad(chunk, exact=False, cache="f32"):
        with Trainer(dream_resident, LoraConfig(seed=3), cache_type=cache, window=n, chunk=chunk, exact=exact,
                     optimizer=OptimizerConfig(lr=0.0)) as tr:
            _with_random_b(tr, std=0.02)
            assert all(r.ok for r in tr.train_window(tokens, mask))
            return tr.gradients()

    g1 = grad(n)
    found = {}
    for chunk in (32, 16):
        g = grad(chunk, exact=True)
        found[chunk] = (rel_l2(g, g1), cosine(g, g1))
    q8 = cosine(grad(16, exact=True, cache="q8_0"), g1)
    plain = cosine(grad(16), g1)
    report("default model, 64 tokens, 16 unlabelled in front: " +
           ", ".join(f"{n // c} chunks rel L2 {e:.2e} (cosine {cs:.8f})" for c, (e, cs) in found.items()) +
           f"; 4 chunks q8_0 cosine {q8:.6f}; plain walk 4 chunks cosine {plain:.6f}")
    assert all(e <= 1e-5 for e, _ in found.values())
    assert q8 >= 0.99
