"""Shared-prefix groups against G separate windows accumulated into one update.

The reference never runs the group walk: for each reply it trains the window
(prompt + reply) as ONE chunk (the native whole-window graph, which reads no
cache, no leaves, no adjoints; itself 9.8e-6 from the float64 oracle) and
takes that window's gradient; the reference gradient is sum_g w_g * grad_g / G
in float64, and its update is ggml-opt's AdamW on it (numpy_ref.adamw_step).
With unit weights the reference is also the native `accumulate_windows = G`
run of the G windows. Numbers print with `pytest -s` (lines `[groups] ...`).
"""
from __future__ import annotations

import numpy as np
import numpy_ref as ref
import pytest
from test_oracle import _with_random_b

RANK, ALPHA = 2, 4.0
PROMPT = ("The dream stage trains a LoRA adapter between decode batches, on the same llama context that serves. "
          "A group is one prompt with several replies, each with its own weight.")
REPLIES = ["Yes, and the prompt runs once.", "No.", "Every reply reads the prompt's K/V as gradient leaves here",
           "Maybe later", "The adjoints add up over the replies, then the prompt goes backward once.",
           "Twelve tokens or so, a middle length", "Ok", "Negative weights push a reply away"]
# Mixed and negative, powers of two: a weight scales its reply's loss inside the
# graph, and a power of two does so without changing float32 rounding, so the
# comparison sees the schedule and not the rounding (see test_weight_rounding_floor).
WEIGHTS = [1.0, -0.5, 2.0, 0.25, -1.0, 0.5, 4.0, -0.25]
LR = 1e-2


def rel_l2(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def report(msg: str) -> None:
    print(f"[groups] {msg}")


def _trainer(resident, *, chunk, window, lr=0.0, accumulate=1, exact=False, horizon=-1):
    from trainer_testing import ProbedTrainer as Trainer

    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig
    # eps = 1: the AdamW step is a smooth function of g (see test_exact_walk.py)
    return Trainer(resident, LoraConfig(rank=RANK, alpha=ALPHA, targets=ref.TARGETS, seed=11),
                   cache_type="f32", window=window, chunk=chunk, exact=exact, horizon=horizon,
                   optimizer=OptimizerConfig(lr=lr, eps=1.0, grad_clip=0.0, accumulate_windows=accumulate))


@pytest.fixture(scope="module")
def material(tiny_resident):
    prompt = tiny_resident.tokenize(PROMPT)
    replies = []
    for i, text in enumerate(REPLIES):
        toks = tiny_resident.tokenize(" " + text, add_special=False)
        mask = np.ones(len(toks), np.uint8)
        if i % 3 == 2 and len(toks) > 3:
            mask[1] = 0           # a reply with an untrained token in its middle
        replies.append((np.asarray(toks, np.int32), mask, WEIGHTS[i]))
    return np.asarray(prompt, np.int32), replies


def _window_of(prompt, reply):
    toks, mask, _ = reply
    return np.concatenate([prompt, toks]), np.concatenate([np.zeros(len(prompt), np.uint8), mask])


def _separate(resident, prompt, replies, window, theta):
    """Per reply: the one-chunk gradient and loss of the window prompt + reply."""
    grads, losses = [], []
    with _trainer(resident, chunk=window, window=window) as tr:
        for reply in replies:
            tr.set_lora_parameters(theta)
            tokens, mask = _window_of(prompt, reply)
            receipts = tr.train_window(tokens, mask)
            assert [r.chunk_tokens for r in receipts] == [len(tokens)] and receipts[0].ok
            grads.append(tr.gradients())
            losses.append(tr.window_loss(receipts))
    return grads, losses


@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("chunk", [64, 7], ids=["one-chunk-parts", "chunk-7"])
def test_group_gradient_equals_separate_windows(tiny_resident, material, G, chunk):
    prompt, replies = material
    replies = replies[:G]
    window = len(prompt) + max(len(r[0]) for r in replies)
    with _trainer(tiny_resident, chunk=min(chunk, window), window=window, lr=LR) as tr:
        theta = _with_random_b(tr)
        receipts = tr.train_group(prompt, replies)
        assert all(r.ok for r in receipts), [r.message for r in receipts if not r.ok]
        g = tr.gradients()
        update = tr.lora_parameters() - theta
        losses = tr.group_reply_losses()
        _, _, t = tr.optimizer_state()
    grads, ref_losses = _separate(tiny_resident, prompt, replies, window, theta)
    weights = np.array([w for _, _, w in replies])
    g_ref = sum(w * gi for w, gi in zip(weights, grads, strict=True)) / G
    zeros = np.zeros_like(g_ref)
    theta_ref, _, _ = ref.adamw_step(theta, g_ref, zeros, zeros, 1, lr=LR, beta1=0.9, beta2=0.999, eps=1.0, wd=0.0)
    update_ref = theta_ref - theta

    # the schedule: the shared prompt forward once (chunks of at most `chunk`), each
    # reply as child chunks, the shared prompt backward once; one optimizer update
    S = len(prompt) - 1
    shared = [r for r in receipts if r.group_reply == G]
    fwd = [r for r in shared if r.walk_pass == "forward"]
    bwd = [r for r in shared if r.walk_pass == "backward"]
    assert sum(r.chunk_tokens for r in fwd) == S and sum(r.chunk_tokens for r in bwd) == S
    assert max(r.chunk_pos for r in fwd) < min(r.chunk_pos for r in receipts if 0 <= r.group_reply < G)
    assert [r.group_reply for r in receipts if 0 <= r.group_reply < G] == \
        sorted(r.group_reply for r in receipts if 0 <= r.group_reply < G)
    for k, (toks, _, _) in enumerate(replies):
        mine = [r for r in receipts if r.group_reply == k and r.walk_pass == "backward"]
        # the prompt's last token and the reply but its last token
        assert sum(r.chunk_tokens for r in mine) == len(toks) - _trailing_untrained(replies[k])
        assert min(r.chunk_pos for r in mine) == S
    assert all(r.exact and r.horizon == 0 for r in receipts)
    assert t == 1

    err, err_upd = rel_l2(g, g_ref), rel_l2(update, update_ref)
    err_loss = max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True))
    report(f"G={G}, chunk {chunk}, prompt {len(prompt)}, replies {[len(r[0]) for r in replies]}, weights "
           f"{weights.tolist()}: gradient rel L2 {err:.2e}, update rel L2 {err_upd:.2e}, per-reply loss rel "
           f"{err_loss:.1e}, {len(receipts)} micro-steps")
    assert np.linalg.norm(g_ref) > 0 and np.count_nonzero(g) > 0.9 * g.size
    assert err <= 1e-5
    assert np.count_nonzero(update) == update.size and np.count_nonzero(update_ref) == update_ref.size
    assert err_upd <= 1e-5
    assert err_loss <= 1e-5


def _trailing_untrained(reply) -> int:
    """Reply tokens after its last trained one: no chunk needs to run them."""
    mask = reply[1]
    return len(mask) - 1 - int(np.flatnonzero(mask)[-1])


def test_unit_weights_equal_accumulate_windows(tiny_resident, material):
    """With every weight 1 the group's update is the native run of its G windows
    with accumulate_windows = G (one AdamW step on their mean gradient)."""
    prompt, replies = material
    replies = [(t, m, 1.0) for t, m, _ in replies[:3]]
    window = len(prompt) + max(len(r[0]) for r in replies)
    with _trainer(tiny_resident, chunk=16, window=window, lr=LR) as tr:
        theta = _with_random_b(tr)
        assert all(r.ok for r in tr.train_group(prompt, replies))
        g, update = tr.gradients(), tr.lora_parameters() - theta
    with _trainer(tiny_resident, chunk=window, window=window, lr=LR, accumulate=3) as tr:
        tr.set_lora_parameters(theta)
        for reply in replies:
            assert all(r.ok for r in tr.train_window(*_window_of(prompt, reply)))
        g_sum, update_ref = tr.gradients(), tr.lora_parameters() - theta
    err, err_upd = rel_l2(g, g_sum / 3), rel_l2(update, update_ref)
    report(f"unit weights, G=3 vs accumulate_windows=3: gradient rel L2 {err:.2e}, update rel L2 {err_upd:.2e}")
    assert err <= 1e-5 and err_upd <= 1e-5
    assert np.count_nonzero(update) == update.size


def test_weight_rounding_floor(tiny_resident, material):
    """Weights that are not powers of two: the group is still within 1e-5, and
    the control shows that this is float32 rounding of the graph itself: the
    same one-chunk graph (a 1-token prompt, so no shared cells, no leaves) with
    its loss scaled by 0.3 moves as far from 0.3 x its unscaled gradient."""
    prompt, replies = material
    replies = [(t, m, w) for (t, m, _), w in zip(replies[:3], (0.3, -0.7, 1.3), strict=True)]
    window = len(prompt) + max(len(r[0]) for r in replies)
    with _trainer(tiny_resident, chunk=16, window=window) as tr:
        theta = _with_random_b(tr)
        assert all(r.ok for r in tr.train_group(prompt, replies))
        g = tr.gradients()
        tokens, mask = _window_of(prompt, replies[0])
        one = [(tokens[1:], mask[1:], 1.0)]
        tr.set_lora_parameters(theta)
        assert all(r.ok for r in tr.train_group(tokens[:1], one))
        g_unit = tr.gradients()
        tr.set_lora_parameters(theta)
        assert all(r.ok for r in tr.train_group(tokens[:1], [(tokens[1:], mask[1:], 0.3)]))
        g_scaled = tr.gradients()
    grads, _ = _separate(tiny_resident, prompt, replies, window, theta)
    g_ref = sum(w * gi for (_, _, w), gi in zip(replies, grads, strict=True)) / 3
    err, floor = rel_l2(g, g_ref), rel_l2(g_scaled, 0.3 * g_unit)
    report(f"weights 0.3, -0.7, 1.3 (G=3, chunk 16): gradient rel L2 {err:.2e}; the one-chunk graph with its loss "
           f"scaled by 0.3 vs 0.3 x unscaled: {floor:.2e}; unscaled vs the window: {rel_l2(g_unit, grads[0]):.1e}")
    assert rel_l2(g_unit, grads[0]) <= 1e-6   # the 1-token-prompt group is the window's own graph
    assert err <= max(1e-5, 3 * floor)   # within float32's own floor for this graph
    assert floor > 1e-7   # the rounding floor is real, not a broken comparison


def test_a_group_then_a_window(tiny_resident, material):
    """A window after a group trains as a plain window again (weight 1, no group state)."""
    prompt, replies = material
    window = len(prompt) + max(len(r[0]) for r in replies)
    tokens, mask = _window_of(prompt, replies[0])
    with _trainer(tiny_resident, chunk=window, window=window) as tr:
        theta = _with_random_b(tr)
        assert all(r.ok for r in tr.train_group(prompt, replies[:2]))
        assert len(tr.group_reply_losses()) == 2
        tr.set_lora_parameters(theta)
        receipts = tr.train_window(tokens, mask)
        assert all(r.group_reply == -1 for r in receipts)
        assert tr.group_reply_losses() == []
        g = tr.gradients()
    grads, _ = _separate(tiny_resident, prompt, replies[:1], window, theta)
    assert rel_l2(g, grads[0]) <= 1e-6


@pytest.mark.parametrize("case, needle", [
    ("empty_prompt", "n_prefix 0"),
    ("no_replies", "n_replies 0"),
    ("empty_reply", "reply 1 has 0 tokens"),
    ("unmasked_reply", "reply 0 has no loss token"),
    ("nan_weight", "reply 0 has weight nan"),
    ("too_long", "exceed the window"),
    ("bad_token", "outside the vocabulary"),
])
def test_bad_groups_are_refused_by_name(tiny_resident, material, case, needle):
    prompt, replies = material
    toks, mask, _ = replies[0]
    args = {
        "empty_prompt": ([], [(toks, mask, 1.0)]),
        "no_replies": (prompt, []),
        "empty_reply": (prompt, [(toks, mask, 1.0), ([], [], 1.0)]),
        "unmasked_reply": (prompt, [(toks, np.zeros_like(mask), 1.0)]),
        "nan_weight": (prompt, [(toks, mask, float("nan"))]),
        "too_long": (prompt, [(np.concatenate([toks] * 20), np.ones(20 * len(toks), np.uint8), 1.0)]),
        "bad_token": (prompt, [(np.array([10**7], np.int32), np.ones(1, np.uint8), 1.0)]),
    }[case]
    with _trainer(tiny_resident, chunk=16, window=len(prompt) + 40) as tr:
        if case in ("no_replies", "empty_prompt"):
            says = "at least one reply" if case == "no_replies" else "at least one token"
            with pytest.raises(ValueError, match=says):
                tr.begin_group(*args)
            # the native check too, past the Python one
            import ctypes

            from dreamstage.native import dream_h
            r = dream_h.DreamReceiptC()
            p = np.ascontiguousarray(prompt if case == "no_replies" else [1], np.int32)
            t, m = np.ascontiguousarray(toks, np.int32), np.ascontiguousarray(mask, np.uint8)
            n, w = np.array([len(toks)], np.int32), np.array([1.0], np.float32)
            i32 = ctypes.POINTER(ctypes.c_int32)
            args = (p.ctypes.data_as(i32), len(p), None, None, None, None, 0) if case == "no_replies" else \
                (p.ctypes.data_as(i32), 0, t.ctypes.data_as(i32), m.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                 n.ctypes.data_as(i32), w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1)
            st = tr.L.dream_group_begin(tr._handle(), *args, ctypes.byref(r))
            assert st == dream_h.DREAM_STATUS_ERROR and needle in r.message.decode()
            return
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            tr.begin_group(*args)
        assert tr.chunks_left == 0


def test_a_horizon_stage_refuses_groups(tiny_resident, material):
    prompt, replies = material
    with _trainer(tiny_resident, chunk=8, window=len(prompt) + 40, exact=True, horizon=8) as tr:
        with pytest.raises(ValueError, match="horizon 8"):
            tr.begin_group(prompt, replies[:2])


@pytest.mark.parametrize("chunk", [7, 16])
def test_both_paths_and_the_cost_model_schedule(tiny_resident, material, chunk):
    """share_prefix=False (G separate exact windows in one update) gives the same
    gradient; each path's micro-steps are exactly what dreamstage.training.walk.groups predicts
    for it (the cost model prices those lists)."""
    from dreamstage.training.walk.groups import group_steps, prefer_group, separate_steps
    prompt, replies = material
    replies = [(t, np.ones_like(m), w) for t, m, w in replies[:4]]
    lens = [len(t) for t, _, _ in replies]
    window = len(prompt) + max(lens)
    out = {}
    for share in (True, False):
        with _trainer(tiny_resident, chunk=chunk, window=window) as tr:
            _with_random_b(tr)
            receipts = tr.train_group(prompt, replies, share_prefix=share)
            assert all(r.ok for r in receipts)
            out[share] = (tr.gradients(), [(r.walk_pass, r.chunk_tokens) for r in receipts], tr.group_reply_losses())
    assert out[True][1] == group_steps(len(prompt), lens, chunk)
    assert out[False][1] == separate_steps(len(prompt), lens, chunk, exact=True)
    err = rel_l2(out[False][0], out[True][0])
    report(f"share_prefix off vs on, chunk {chunk}: gradient rel L2 {err:.2e}; steps {len(out[False][1])} vs "
           f"{len(out[True][1])}")
    assert err <= 1e-5
    assert np.allclose(out[False][2], out[True][2], rtol=1e-5)
    # the measured model: one reply never pays, a long prompt with many replies does
    assert not prefer_group(512, [16], 256, exact=True)
    assert prefer_group(512, [16] * 8, 256, exact=True)
    assert not prefer_group(2, [64] * 4, 256, exact=True)


def test_rendered_windows_assemble_into_groups():
    """Pure bookkeeping: the prefix stops before the first trained token of any
    window, windows() gives the separate windows back, group_by_prefix joins
    only windows with one rendered prompt of at least two tokens."""
    from dreamstage.training.walk.groups import assemble_group, group_by_prefix
    from dreamstage.training.walk.windows import TrainWindow
    a = TrainWindow((1, 2, 3, 4, 5), (0, 0, 0, 1, 1), 0, "a")
    b = TrainWindow((1, 2, 3, 7), (0, 0, 0, 1), 1, "b")
    c = TrainWindow((1, 2, 9, 9), (0, 0, 1, 1), 2, "c")      # shares 2 tokens, trains from the third
    d = TrainWindow((8, 2, 3), (0, 1, 1), 3, "d")           # a 1-token prompt: never grouped
    g = assemble_group([a, b, c], [1.0, -2.0, 0.5], chunk=64, source=0, label="x")
    assert g.prefix == (1, 2)
    assert [r[0] for r in g.replies] == [(3, 4, 5), (3, 7), (9, 9)]
    assert [r[2] for r in g.replies] == [1.0, -2.0, 0.5]
    assert [(w.tokens, w.mask) for w in g.windows()] == [(x.tokens, x.mask) for x in (a, b, c)]
    assert g.structure() == {"label": "x", "prefix_tokens": 2, "G": 3, "reply_tokens": [3, 2, 2],
                             "weights": [1.0, -2.0, 0.5], "shared_prefix": False}
    out = group_by_prefix([a, d, b, c], chunk=64)
    assert [type(x).__name__ for x in out] == ["TrainGroup", "TrainWindow", "TrainWindow"]
    assert out[0].prefix == (1, 2, 3) and len(out[0].replies) == 2 and out[1] is d and out[2] is c
    with pytest.raises(ValueError, match="one weight per window"):
        assemble_group([a, b], [1.0], chunk=64)


def test_a_group_counts_as_one_window_of_accumulate_windows(tiny_resident, material):
    """accumulate_windows = 2: a plain window, then a group; the accumulator holds
    their sum (the group's share already the mean over its replies) and the one
    update uses the mean of the two."""
    prompt, replies = material
    replies = replies[:3]
    window = len(prompt) + max(len(r[0]) for r in replies)
    tokens, mask = _window_of(prompt, replies[1])
    # exact: the plain window in chunks of 16 must give its whole-window gradient too
    with _trainer(tiny_resident, chunk=16, window=window, lr=LR, accumulate=2, exact=True) as tr:
        theta = _with_random_b(tr)
        assert all(r.ok for r in tr.train_window(tokens, mask))
        assert tr.optimizer_state()[2] == 0
        assert all(r.ok for r in tr.train_group(prompt, replies))
        g, update, (_, _, t) = tr.gradients(), tr.lora_parameters() - theta, tr.optimizer_state()
    grads, _ = _separate(tiny_resident, prompt, replies, window, theta)
    g_group = sum(w * gi for (_, _, w), gi in zip(replies, grads, strict=True)) / 3
    g_ref = grads[1] + g_group
    zeros = np.zeros_like(g_ref)
    theta_ref, _, _ = ref.adamw_step(theta, g_ref / 2, zeros, zeros, 1, lr=LR, beta1=0.9, beta2=0.999, eps=1.0, wd=0.0)
    err, err_upd = rel_l2(g, g_ref), rel_l2(update, theta_ref - theta)
    report(f"a window then a group, accumulate_windows=2: gradient rel L2 {err:.2e}, update rel L2 {err_upd:.2e}")
    assert t == 1 and err <= 1e-5 and err_upd <= 1e-5 and np.count_nonzero(update) == update.size
