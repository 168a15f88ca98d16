"""Soft targets for a window (dream_window_soft_targets, Trainer.begin_window(soft=)):
the native loss and gradient against the float64 NumPy reference
(tests/numpy_ref.py) trained on the same target distributions, rows that
sum to 1 and rows that leave a rest (the mass of every token outside them,
one outcome), the model's own truncated distribution as a stationary
target, and the call's refusals of bad input."""
from __future__ import annotations

import ctypes

import numpy as np
import numpy_ref as ref
import pytest
from test_oracle import _ref_lora, _trainer, _window, _with_random_b, rel_l2, report

from dreamstage.native import dream_h
from dreamstage.training.walk.receipts import Receipt


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_path):
    return ref.LlamaRef.from_gguf(tiny_model_path)


def _soft_rows(n_rows: int, n_vocab: int, k: int, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """k (id, probability) pairs per row: random distinct ids, Dirichlet probabilities;
    row 0 repeats an id (the probabilities add) and row 1 ends with a padding pair."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(n_vocab, k, replace=False) for _ in range(n_rows)]).astype(np.int32)
    probs = rng.dirichlet(np.full(k, 0.5), size=n_rows).astype(np.float32)
    ids[0, 1] = ids[0, 0]
    probs[1, -2] += probs[1, -1]
    ids[1, -1], probs[1, -1] = -1, 0.0
    return ids, probs


def _with_rest(probs: np.ndarray, seed: int = 9) -> np.ndarray:
    """Every other row scaled to a sum in [0.6, 0.99]: the rest, 1 - its sum, on every token it leaves out."""
    out = probs.copy()
    rng = np.random.default_rng(seed)
    out[::2] *= rng.uniform(0.6, 0.99, size=(len(out[::2]), 1)).astype(np.float32)
    return out


def _dense(ids: np.ndarray, probs: np.ndarray, n_vocab: int) -> np.ndarray:
    """The rows over the vocabulary, as the native side takes them: rescaled only where
    rounding takes them over 1 (a row that sums below 1 leaves its rest out)."""
    out = np.zeros((ids.shape[0], n_vocab))
    for r in range(ids.shape[0]):
        for i, p in zip(ids[r], probs[r].astype(np.float64), strict=True):
            if i >= 0:
                out[r, i] += p
    return out / np.maximum(out.sum(axis=1, keepdims=True), 1.0)


@pytest.mark.parametrize("rest", [False, True], ids=["rows-sum-to-1", "rows-leave-a-rest"])
@pytest.mark.parametrize("chunk", [32, 8], ids=["one-chunk", "three-chunks"])
def test_soft_target_gradient_matches_reference(tiny_resident, tiny_ref, chunk, rest):
    tokens, mask = _window(tiny_resident)
    lp = ref.positions_from_mask(mask)
    n_vocab = tiny_resident.n_vocab
    ids, probs = _soft_rows(int(mask[1:].sum()), n_vocab, k=24)
    if rest:
        probs = _with_rest(probs)
    with _trainer(tiny_resident, chunk=chunk) as tr:
        theta = _with_random_b(tr)
        tr.begin_window(tokens, mask, soft=(ids, probs))
        receipts = tr._steps_to_end()
        assert all(r.ok for r in receipts) and len(receipts) == -(-len(tokens) // chunk)
        native_grad, native_loss = tr.gradients(), tr.window_loss(receipts)
        # the same window with one-hot labels: another gradient (the soft rows reached the loss)
        tr.train_window(tokens, mask)
        hard_grad = tr.gradients()
        order = tr.parameter_order()
    lora = _ref_lora(tr, theta)
    dense = _dense(ids, probs, n_vocab)
    ref_loss, grads = ref.plain_walk_grad(tiny_ref, tokens, lp, lora, chunk, targets=dense)
    ref_grad = ref.flat_grad(grads, order)
    err, loss_err = rel_l2(native_grad, ref_grad), abs(native_loss - ref_loss) / abs(ref_loss)
    hard_err = rel_l2(hard_grad, ref_grad)
    report(f"soft targets (k 24, chunk {chunk}, rest {rest}, {ref_grad.size} params): gradient rel L2 {err:.2e}, loss "
           f"{native_loss:.6f} vs {ref_loss:.6f}; the one-hot gradient is {hard_err:.2f} away")
    assert np.count_nonzero(ref_grad) == ref_grad.size
    assert np.count_nonzero(native_grad) == native_grad.size
    assert loss_err <= 1e-5
    assert err <= 1e-4
    assert hard_err > 0.1


def test_the_models_own_top_k_with_its_rest_is_a_stationary_target(tiny_resident, tiny_ref):
    """Rows of the model's own next-token probabilities on its top k tokens, not
    renormalized (the drift guard's rehearsal targets): the rest is the mass of
    every other token, so the model is already the target and the gradient
    vanishes. The same rows renormalized over the k tokens ask the model to move
    the rest onto them: a gradient as large as a real target's. The reference's
    loss at its minimum is the target's entropy with the rest as one outcome."""
    tokens, mask = _window(tiny_resident)
    lp = ref.positions_from_mask(mask)
    k = 8
    with _trainer(tiny_resident) as tr:
        theta = _with_random_b(tr)
        lora = _ref_lora(tr, theta)
        x = ref.Forward(tiny_ref, tokens, lora)
        idx = np.nonzero(lp)[0]
        logits = x.z[idx] @ tiny_ref.output_t
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        top = np.argsort(-logp, axis=1)[:, :k].astype(np.int32)
        p_top = np.take_along_axis(np.exp(logp), top, axis=1)
        own = (top, p_top.astype(np.float32))
        renormalized = (top, (p_top / p_top.sum(axis=1, keepdims=True)).astype(np.float32))
        grads, losses = {}, {}
        other = _soft_rows(len(idx), tiny_resident.n_vocab, k)
        for name, soft in (("own", own), ("renormalized", renormalized), ("other", other)):
            losses[name] = tr.window_loss(tr.train_window(tokens, mask, soft=soft))
            grads[name] = tr.gradients()
    rest = 1.0 - p_top.sum(axis=1)
    entropy = float(np.mean(-(p_top * np.log(p_top)).sum(axis=1) - rest * np.log(rest)))
    norm = {name: float(np.linalg.norm(g)) for name, g in grads.items()}
    report(f"soft targets at the model's own top {k} (rest {rest.mean():.3f} on average): gradient norm "
           f"{norm['own']:.2e}, renormalized {norm['renormalized']:.2e}, another target {norm['other']:.2e}; "
           f"loss {losses['own']:.6f} against the entropy {entropy:.6f}")
    assert rest.min() > 0.01                     # the rows do leave mass out
    assert norm["own"] < 1e-3 * norm["other"]
    assert norm["renormalized"] > 100 * norm["own"]
    assert abs(losses["own"] - entropy) <= 1e-4 * entropy


def test_one_hot_soft_targets_give_the_one_hot_gradient(tiny_resident):
    """Soft rows that put all mass on each next token are the plain window, bit for bit;
    and the next window_begin drops soft targets (its window trains one-hot labels)."""
    tokens, mask = _window(tiny_resident)
    nxt = np.asarray(tokens)[1:][mask[1:].astype(bool)]
    one_hot = (nxt[:, None].astype(np.int32), np.ones((len(nxt), 1), np.float32))
    other = _soft_rows(len(nxt), tiny_resident.n_vocab, k=8)
    with _trainer(tiny_resident) as tr:
        _with_random_b(tr)
        plain = [r.loss for r in tr.train_window(tokens, mask)], tr.gradients()
        soft = [r.loss for r in tr.train_window(tokens, mask, soft=one_hot)], tr.gradients()
        tr.train_window(tokens, mask, soft=other)
        after = [r.loss for r in tr.train_window(tokens, mask)], tr.gradients()
    assert soft[0] == plain[0] and np.array_equal(soft[1], plain[1])
    assert after[0] == plain[0] and np.array_equal(after[1], plain[1])


def test_soft_targets_refuse_bad_input(tiny_resident):
    tokens, mask = _window(tiny_resident)
    n = int(mask[1:].sum())
    v = tiny_resident.n_vocab
    ids, probs = _soft_rows(n, v, k=4)
    with _trainer(tiny_resident) as tr:
        def refused(ids_, probs_, match):
            tr.begin_window(tokens, mask)
            with pytest.raises(ValueError, match=match):
                tr.begin_window(tokens, mask, soft=(ids_, probs_))
        refused(ids[:-1], probs[:-1], rf"n_rows {n - 1} must be the window's {n} loss tokens")
        bad = probs.copy()
        bad[3] *= 1.5
        refused(ids, bad, r"row 3's probabilities sum to 1\.5, over 1")
        bad_ids = ids.copy()
        bad_ids[2, 1] = v
        refused(bad_ids, probs, rf"row 2, pair 1: id {v} ")
        neg = probs.copy()
        neg[4, 0] = -0.25
        refused(ids, neg, r"row 4, pair 0: id \d+ with probability -0\.25")
        pad = ids.copy()
        pad[0, 2] = -1
        refused(pad, probs, r"row 0, pair 2: id -1 with probability")
        refused(ids[:, :0], probs[:, :0], r"k 0 must be 1\.\.")
        with pytest.raises(ValueError, match=r"ids \(\d+, 4\) and probs \(\d+,\) must be 2-D"):
            tr.begin_window(tokens, mask, soft=(ids, probs[:, 0]))
        # after a window's first micro-step its targets are fixed
        chunked = _trainer(tiny_resident, chunk=8)
        with chunked:
            chunked.begin_window(tokens, mask)
            assert chunked.micro_step().ok
            r = dream_h.DreamReceiptC()
            st = chunked.L.dream_window_soft_targets(chunked._handle(), ids.ctypes.data_as(
                ctypes.POINTER(ctypes.c_int32)), probs.ctypes.data_as(
                ctypes.POINTER(ctypes.c_float)), 4, n, ctypes.byref(r))
            assert st == dream_h.DREAM_STATUS_ERROR
            assert "before its first micro-step" in Receipt.from_c(r).message
        # a refused call changed nothing: the window trains its one-hot labels
        plain = [r.loss for r in tr.train_window(tokens, mask)]
        with pytest.raises(ValueError):
            tr.begin_window(tokens, mask, soft=(ids, bad))
        assert [r.loss for r in tr._steps_to_end()] == plain


def test_rows_with_a_rest_through_the_exact_walk_and_recompute(tiny_resident):
    """The rest's loss node in the exact walk (three chunks) gives the one-chunk
    gradient, and with recompute the plain walk's, to float rounding."""
    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer
    tokens, mask = _window(tiny_resident)
    ids, probs = _soft_rows(int(mask[1:].sum()), tiny_resident.n_vocab, k=24)
    soft = (ids, _with_rest(probs))
    grads = {}
    for name, chunk, kw in (("one chunk", 32, {}), ("exact", 8, {"exact": True}), ("plain", 8, {}),
                            ("recompute", 8, {"recompute": True})):
        with Trainer(tiny_resident, LoraConfig(rank=4, alpha=8, targets=("attn_q", "attn_v"), seed=11),
                     cache_type="f32", window=32, chunk=chunk, optimizer=OptimizerConfig(lr=0.0), **kw) as tr:
            _with_random_b(tr)
            assert all(r.ok for r in tr.train_window(tokens, mask, soft=soft))
            grads[name] = tr.gradients()
    exact, recompute = rel_l2(grads["exact"], grads["one chunk"]), rel_l2(grads["recompute"], grads["plain"])
    report(f"soft rows with a rest: exact walk vs one chunk rel L2 {exact:.2e}, recompute vs plain {recompute:.2e}")
    assert np.count_nonzero(grads["one chunk"]) == grads["one chunk"].size
    assert exact <= 1e-5 and recompute <= 1e-6
    assert rel_l2(grads["plain"], grads["one chunk"]) > 0.1     # the plain walk's chunks do stop the gradient
