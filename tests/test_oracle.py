"""The independent gradient oracle.

tests/numpy_ref.py re-implements the tiny llama in float64 NumPy with an exact
backward pass. Here it is checked, in order, against:
1. itself: central finite differences over the whole LoRA vector;
2. llama.cpp's forward pass: all-position logits of the tiny F32 model;
3. the native dream stage's loss, gradients and AdamW update (the oracle).
See docs/architecture/oracle.md for the measured numbers.
"""
from __future__ import annotations

import numpy as np
import pytest

import numpy_ref as ref

PROMPT = ("The dream stage trains a LoRA adapter between decode batches, "
          "on the same llama context that serves.")


def rel_l2(x, y) -> float:
    """||x - y|| / ||y|| in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def report(msg: str) -> None:
    # Printed numbers appear with `pytest -s`, and in the -ra summary on failure.
    print(f"[oracle] {msg}")


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_path):
    return ref.LlamaRef.from_gguf(tiny_model_path)


@pytest.fixture(scope="module")
def tiny_resident(tiny_model_path):
    """The tiny model resident with an F32 K/V cache and no flash attention (a pure F32 forward)."""
    from dreamstage.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=256, n_seq=1,
                                     n_threads=2, kv_type="f32", flash_attn="off"))
    yield m
    m.close()


def native_all_logits(m, tokens) -> np.ndarray:
    """llama.cpp's logits at every position of one fresh sequence, (T, n_vocab) float32."""
    lc = m.lc
    lc.llama_memory_seq_rm(m.memory, 0, -1, -1)
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = True
        assert lc.llama_decode(m.ctx, batch) == 0
        out = np.empty((len(tokens), m.n_vocab), np.float32)
        for i in range(len(tokens)):
            out[i] = np.ctypeslib.as_array(lc.llama_get_logits_ith(m.ctx, i), shape=(m.n_vocab,))
    finally:
        lc.llama_batch_free(batch)
        lc.llama_memory_seq_rm(m.memory, 0, -1, -1)
    return out


# -- 1. the reference against itself ------------------------------------------

def _small_vocab(model: ref.LlamaRef, n_vocab: int) -> ref.LlamaRef:
    """The same blocks with the (tied) head cut to the first n_vocab rows.

    Finite differences need two forwards per parameter; at the full 49152-row
    head a forward costs ~0.1 s, so the whole-vector check runs on this copy.
    The backward code under test is the same; only the softmax is narrower.
    """
    import dataclasses
    return dataclasses.replace(model, tok_embd=model.tok_embd[:n_vocab], output=model.output[:n_vocab])


def test_reference_backward_matches_whole_vector_finite_differences(tiny_ref):
    model = _small_vocab(tiny_ref, 256)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 256, 12)
    lp = np.ones(12, bool)
    lp[[0, 1, 5, 11]] = False
    lora = ref.Lora.random(model, ref.TARGETS, rank=1, alpha=2.0, seed=3, b_std=0.2)
    order = [(k, ab) for k in lora.keys() for ab in ("a", "b")]
    theta = lora.flat(order)
    _, grads = ref.loss_and_grad(model, tokens, lp, lora)
    analytic = ref.flat_grad(grads, order)
    h = 1e-5  # float64: truncation ~h^2, rounding ~1e-16/h; both far below 1e-8
    fd = np.empty_like(theta)
    for i in range(theta.size):
        e = np.zeros_like(theta)
        e[i] = h
        fd[i] = (ref.loss(model, tokens, lp, lora.with_flat(order, theta + e))
                 - ref.loss(model, tokens, lp, lora.with_flat(order, theta - e))) / (2 * h)
    err = rel_l2(analytic, fd)
    report(f"reference backward vs whole-vector FD ({theta.size} params): rel L2 {err:.2e}")
    assert np.count_nonzero(fd) == theta.size
    assert err < 1e-7


def test_reference_masked_positions_do_not_contribute(tiny_ref):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, tiny_ref.tok_embd.shape[0], 10)
    lp = np.zeros(10, bool)
    lp[4] = True
    base = ref.loss(tiny_ref, tokens, lp)
    changed = tokens.copy()
    changed[8] = (changed[8] + 1) % tiny_ref.tok_embd.shape[0]  # after position 4's target: invisible
    assert ref.loss(tiny_ref, changed, lp) == base
    changed[5] = (changed[5] + 1) % tiny_ref.tok_embd.shape[0]  # position 4's target
    assert ref.loss(tiny_ref, changed, lp) != base


def test_reference_plain_walk_stops_gradient_only_at_chunk_boundaries(tiny_ref):
    model = _small_vocab(tiny_ref, 256)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 256, 16)
    lp = np.ones(16, bool)
    lp[-1] = False
    lora = ref.Lora.random(model, ("attn_k", "attn_v", "ffn_up"), rank=2, alpha=4.0, seed=5, b_std=0.2)
    order = [(k, ab) for k in lora.keys() for ab in ("a", "b")]
    full_loss, full = ref.loss_and_grad(model, tokens, lp, lora)
    one_loss, one = ref.plain_walk_grad(model, tokens, lp, lora, chunk=16)
    walk_loss, walk = ref.plain_walk_grad(model, tokens, lp, lora, chunk=4)
    g_full, g_walk = ref.flat_grad(full, order), ref.flat_grad(walk, order)
    cos = float(g_full @ g_walk / np.linalg.norm(g_full) / np.linalg.norm(g_walk))
    assert one_loss == walk_loss == full_loss
    assert rel_l2(ref.flat_grad(one, order), g_full) < 1e-12  # one chunk: nothing is cut
    assert 0.0 < cos < 0.9999                                 # four chunks: K/V paths are cut


# -- 2. the reference against llama.cpp's forward ------------------------------

def test_tiny_model_tokenizes_like_the_default_model(tiny_resident, resident):
    text = "Hello <|im_start|>user\nünïcödé 12345, dreaming<|im_end|>"
    assert tiny_resident.tokenize(text) == resident.tokenize(text)
    assert tiny_resident.chat_template() == resident.chat_template()
    assert (tiny_resident.bos, tiny_resident.eos) == (resident.bos, resident.eos)
    assert tiny_resident.n_vocab == resident.n_vocab


def test_reference_logits_match_llama_cpp_f32(tiny_resident, tiny_ref):
    tokens = tiny_resident.tokenize(PROMPT)
    assert 18 <= len(tokens) <= 40
    native = native_all_logits(tiny_resident, tokens)
    fw = ref.Forward(tiny_ref, tokens)
    err = rel_l2(native, fw.logits)
    report(f"logits, {len(tokens)} positions x {native.shape[1]}: rel L2 {err:.2e}, "
                 f"logit std {fw.logits.std():.2f}")
    assert fw.logits.std() > 1.0  # not a degenerate (near-uniform) head
    assert err < 1e-5
    assert np.array_equal(native.argmax(axis=1), fw.logits.argmax(axis=1))


def test_logit_match_is_sensitive_to_the_rope_pairing(tiny_resident, tiny_ref, monkeypatch):
    """Negative control: rotating half-split (NEOX) pairs instead of adjacent ones is caught."""
    def rope_neox(x, cos, sin, sign=1.0):
        half = x.shape[-1] // 2
        x0, x1, s = x[..., :half], x[..., half:], sign * sin
        return np.concatenate([x0 * cos - x1 * s, x0 * s + x1 * cos], axis=-1)

    tokens = tiny_resident.tokenize(PROMPT)
    native = native_all_logits(tiny_resident, tokens)
    monkeypatch.setattr(ref, "_rope", rope_neox)
    err = rel_l2(native, ref.Forward(tiny_ref, tokens).logits)
    report(f"logits with NEOX pairing (wrong on purpose): rel L2 {err:.2e}")
    assert err > 1e-2


def test_reference_logits_match_llama_cpp_q8_0_with_activation_quantization(tiny_model_q8_path):
    """Q8_0 weights: llama.cpp's CPU matmul also rounds the activations to Q8_0.

    With the weights dequantized but the activations exact, the reference is
    off by a few percent (as far as the weights' own rounding moves it); with
    the activation rounding emulated it matches to float32 accuracy, which
    pins the discrepancy on that one mechanism.
    """
    from dreamstage.resident import ResidentConfig, ResidentModel
    model = ref.LlamaRef.from_gguf(tiny_model_q8_path)
    assert set(model.weight_types.values()) == {ref.GGML_TYPE_Q8_0}
    with ResidentModel(ResidentConfig(model_path=str(tiny_model_q8_path), n_ctx=64, n_seq=1,
                                      n_threads=2, kv_type="f32", flash_attn="off")) as m:
        tokens = m.tokenize(PROMPT)
        native = native_all_logits(m, tokens)
    plain = rel_l2(native, ref.Forward(model, tokens).logits)
    emulated = rel_l2(native, ref.Forward(model, tokens, act_quant=True).logits)
    report(f"Q8_0 logits: rel L2 {plain:.2e} (exact activations), {emulated:.2e} (Q8_0 activations emulated)")
    assert emulated < 1e-5
    assert plain > 100 * emulated
