"""The adapter bank: sequences on different LoRA adapters and on the base in ONE
decode batch, each equal to its adapter served alone through llama.cpp's own
path (llama_set_adapters_lora); an unarmed decode is bit-identical to the
decode without a bank; bad files, a full bank and empty slots are refused."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from dreamstage.adapters.bank import BASE, AdapterBank, AdapterBankError
from dreamstage.adapters.files import save_lora

PROMPT = "The adapter bank serves many adapters in one batch."
STEPS = 4
REL_L2 = 1e-4     # CPU, F32 factors: only the scale's place (folded into B) and the batch layout differ
# The default model's Q4_1 products quantize activations to 8 bits: a prompt without
# BOS (random tokens) turns rounding-sized differences into 1e-2 in its logits, so
# random prompts are checked on the tiny F32 model, where rounding stays rounding.
REL_L2_F32 = 1e-5
# The bgmv gather sums in its own order, and the dense gather's product over every
# slot is another MUL_MAT shape, which a CPU may tile differently (an AVX-512 machine
# does): on the Q4_1 model that rounding is amplified as above, so there both are held
# to the greedy tokens and this; the F32 model holds every gather to REL_L2_F32.
REL_L2_Q8 = 1e-1


@pytest.fixture(scope="module")
def rm():
    """The default model with room for three sequences (the session's `resident` holds one)."""
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(n_ctx=512, n_seq=3, n_threads=1))
    yield m
    m.close()


def _dims(rm) -> dict[str, tuple[int, int]]:
    n_embd = rm.n_embd
    n_kv = n_embd // rm.lc.llama_model_n_head(rm.model) * rm.lc.llama_model_n_head_kv(rm.model)
    n_ff = int(rm.meta("llama.feed_forward_length"))
    return {"attn_q": (n_embd, n_embd), "attn_k": (n_embd, n_kv), "attn_v": (n_embd, n_kv),
            "ffn_down": (n_ff, n_embd)}


def _lora(rm, path, rank: int, targets: list[str], seed: int, n_in_off: int = 0, alpha_per_rank: float = 2.0):
    """A LoRA with random A and B (B != 0, so it moves the logits) on every layer;
    its scale alpha / rank is alpha_per_rank (3: a scale whose product rounds)."""
    rng = np.random.default_rng(seed)
    dims = _dims(rm)
    factors = {}
    for layer in range(rm.lc.llama_model_n_layer(rm.model)):
        for t in targets:
            n_in, n_out = dims[t]
            a = rng.uniform(-1, 1, (rank, n_in + n_in_off)) / np.sqrt(n_in)
            b = rng.normal(0, 0.02, (n_out, rank))
            factors[(layer, t)] = (a, b)
    return save_lora(path, factors, alpha=alpha_per_rank * rank, model_arch="llama")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("bank")


@pytest.fixture(scope="module")
def lora_a(rm, files):
    return _lora(rm, files / "a.gguf", 4, ["attn_q", "attn_v"], seed=1, alpha_per_rank=3.0)


@pytest.fixture(scope="module")
def lora_b(rm, files):
    return _lora(rm, files / "b.gguf", 8, ["attn_q", "attn_k", "ffn_down"], seed=2)


def _decode(rm, entries) -> list[np.ndarray]:
    """Decode one batch of (token, pos, seq, wants_logits); the flagged rows' logits."""
    rm.decode_entries(entries)
    return [np.ctypeslib.as_array(rm.lc.llama_get_logits_ith(rm.ctx, i), shape=(rm.n_vocab,)).copy()
            for i, e in enumerate(entries) if e[3]]


def _clear(rm):
    rm.lc.llama_memory_seq_rm(rm.memory, -1, -1, -1)


def _run(rm, seqs: list[tuple[list[int], int]], bank: AdapterBank | None) -> list[list[np.ndarray]]:
    """Prefill each (prompt, slot) as its own sequence in one batch, then STEPS greedy
    decode steps with every sequence in one batch; per sequence its logits rows."""
    _clear(rm)
    entries, slots = [], []
    for s, (toks, slot) in enumerate(seqs):
        entries += [(t, i, s, i == len(toks) - 1) for i, t in enumerate(toks)]
        slots += [slot] * len(toks)
    if bank is not None:
        bank.set_token_adapters(slots)
    rows = _decode(rm, entries)
    out = [[r] for r in rows]
    pos = [len(t) for t, _ in seqs]
    for _ in range(STEPS):
        nxt = [int(np.argmax(o[-1])) for o in out]
        if bank is not None:
            bank.set_token_adapters([slot for _, slot in seqs])
        rows = _decode(rm, [(nxt[s], pos[s], s, True) for s in range(len(seqs))])
        for s, r in enumerate(rows):
            out[s].append(r)
            pos[s] += 1
    if bank is not None:
        bank.set_token_adapters([])     # arming holds until the next call: the next decode is another batch
    _clear(rm)
    return out


def _served_alone(rm, path, toks) -> list[np.ndarray]:
    """The reference: the adapter set on the whole context by llama.cpp's own path."""
    lc = rm.lc
    h = lc.llama_adapter_lora_init(rm.model, str(path).encode())
    assert h
    try:
        arr = (lc.llama_adapter_lora_p_ctypes * 1)(h)
        assert lc.llama_set_adapters_lora(rm.ctx, arr, 1, (ctypes.c_float * 1)(1.0)) == 0
        return _run(rm, [(toks, BASE)], None)[0]
    finally:
        lc.llama_set_adapters_lora(rm.ctx, None, 0, None)
        lc.llama_adapter_lora_free(h)


def _rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _assert_same(rows: list[np.ndarray], ref: list[np.ndarray], what: str, tol: float = REL_L2):
    for i, (x, r) in enumerate(zip(rows, ref, strict=True)):
        assert _rel_l2(x, r) < tol, f"{what}, row {i}: rel L2 {_rel_l2(x, r):.2e}"
        assert int(np.argmax(x)) == int(np.argmax(r)), f"{what}, row {i}: greedy token differs"


def _assert_bit_identical(rows: list[np.ndarray], ref: list[np.ndarray]):
    assert len(rows) == len(ref) == STEPS + 1
    for i, (x, r) in enumerate(zip(rows, ref, strict=True)):
        assert np.array_equal(x, r), f"row {i} differs from the decode without a bank"


@pytest.fixture(scope="module")
def refs(rm, lora_a, lora_b):
    toks = rm.tokenize(PROMPT)
    return {"toks": toks, "a": _served_alone(rm, lora_a, toks), "b": _served_alone(rm, lora_b, toks),
            "base": _run(rm, [(toks, BASE)], None)[0]}


GATHERS = ["id", "dense", "bgmv"]


@pytest.mark.parametrize("gather", GATHERS)
def test_mixed_batch_equals_each_adapter_alone(rm, lora_a, lora_b, refs, gather, monkeypatch):
    """Every way of gathering each token's slot (MUL_MAT_ID, the CPU's default; a
    masked product over every slot; the one-op gather a GPU runs as a kernel, here
    its CPU body), read at the bank's creation."""
    monkeypatch.setenv("DREAMSTAGE_BANK_GATHER", gather)
    toks = refs["toks"]
    with AdapterBank(rm, 4, max_rank=8) as bank:
        sa, sb = bank.load(lora_a), bank.load(lora_b)
        out = _run(rm, [(toks, sa), (toks, sb), (toks, BASE)], bank)
    # the adapters really moved the logits, so the equalities below tell them apart
    assert _rel_l2(refs["a"][0], refs["base"][0]) > 100 * REL_L2
    assert _rel_l2(refs["b"][0], refs["base"][0]) > 100 * REL_L2
    assert _rel_l2(refs["a"][0], refs["b"][0]) > 100 * REL_L2
    tol = REL_L2 if gather == "id" else REL_L2_Q8
    _assert_same(out[0], refs["a"], "seq 0 on adapter A", tol)
    _assert_same(out[1], refs["b"], "seq 1 on adapter B", tol)
    _assert_same(out[2], refs["base"], "seq 2 on the base", tol)


@pytest.mark.parametrize("gather", GATHERS)
def test_mixed_batch_of_random_prompts_on_an_f32_model(tiny_model_path, tmp_path, gather, monkeypatch):
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    monkeypatch.setenv("DREAMSTAGE_BANK_GATHER", gather)
    m = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=256, n_seq=3, n_threads=1,
                                     kv_type="f32", flash_attn="off"))
    try:
        a = _lora(m, tmp_path / "a.gguf", 4, ["attn_q", "attn_v"], seed=1, alpha_per_rank=3.0)
        b = _lora(m, tmp_path / "b.gguf", 8, ["attn_q", "attn_k", "ffn_down"], seed=2)
        toks = [int(t) for t in np.random.default_rng(7).integers(0, m.n_vocab, 24)]
        ra, rb = _served_alone(m, a, toks), _served_alone(m, b, toks)
        base = _run(m, [(toks, BASE)], None)[0]
        with AdapterBank(m, 2, max_rank=8) as bank:
            out = _run(m, [(toks, bank.load(a)), (toks, bank.load(b)), (toks, BASE)], bank)
        for rows, ref in zip(out, (ra, rb, base), strict=True):
            assert max(_rel_l2(x, r) for x, r in zip(rows, ref, strict=True)) < REL_L2_F32
        assert _rel_l2(ra[0], base[0]) > 1e3 * REL_L2_F32 and _rel_l2(rb[0], base[0]) > 1e3 * REL_L2_F32
    finally:
        m.close()


def test_unarmed_decode_is_bit_identical_and_no_graph_goes_stale(rm, lora_a, lora_b, refs):
    toks = refs["toks"]
    before = _run(rm, [(toks, BASE)], None)[0]     # no bank at all
    with AdapterBank(rm, 2, max_rank=8) as bank:
        slot = bank.load(lora_a)
        bank.load(lora_b)
        _assert_bit_identical(_run(rm, [(toks, BASE)], None)[0], before)
        # armed, then the same shapes unarmed (a reused armed graph would add the term), then armed again
        _assert_same(_run(rm, [(toks, slot)], bank)[0], refs["a"], "armed")
        bank.set_token_adapters([BASE] * len(toks))
        _assert_bit_identical(_run(rm, [(toks, BASE)], None)[0], before)
        _assert_same(_run(rm, [(toks, slot)], bank)[0], refs["a"], "armed again")
    _assert_bit_identical(_run(rm, [(toks, BASE)], None)[0], before)


def test_the_bank_outlives_a_scheduler_reserve(rm, lora_a, refs):
    """llama_set_adapters_lora makes the next decode rebuild the context's scheduler:
    a bank made before it still applies its term after it."""
    toks = refs["toks"]
    with AdapterBank(rm, 2, max_rank=8) as bank:
        slot = bank.load(lora_a)
        _assert_same(_served_alone(rm, lora_a, toks), refs["a"], "the context's own adapter")
        _assert_same(_run(rm, [(toks, slot), (toks, BASE)], bank)[0], refs["a"], "the bank after a reserve")


def test_refusals_name_the_file_or_slot(rm, lora_a, lora_b, files):
    garbage = files / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    wrong = _lora(rm, files / "wrong-shape.gguf", 4, ["attn_q"], seed=3, n_in_off=8)
    with AdapterBank(rm, 2, max_rank=4) as bank:
        for bad in (garbage, wrong, files / "missing.gguf"):
            with pytest.raises(AdapterBankError, match=bad.name):
                bank.load(bad)
        with pytest.raises(AdapterBankError, match=r"b\.gguf.*rank 8.*max_rank 4"):
            bank.load(lora_b)
        assert bank.total_bytes == 0          # nothing refused left a stack behind
        s0, s1 = bank.load(lora_a), bank.load(lora_a)
        assert (s0, s1) == (0, 1)
        with pytest.raises(AdapterBankError, match="full"):
            bank.load(lora_a)
        with pytest.raises(AdapterBankError, match="slot 5"):
            bank.set_token_adapters([0, 5])
        with pytest.raises(AdapterBankError, match="slot 7"):
            bank.unload(7)
    with pytest.raises(AdapterBankError, match="capacity"):
        AdapterBank(rm, 0)


def test_unload_then_reuse_a_slot(rm, lora_a, lora_b, refs):
    toks = refs["toks"]
    with AdapterBank(rm, 2, max_rank=8) as bank:
        sa, sb = bank.load(lora_a), bank.load(lora_b)
        per_slot = bank.bytes(sa)
        assert per_slot > 0 and bank.bytes(sb) == per_slot
        assert bank.total_bytes == 3 * per_slot   # two slots and the base's zero slot
        bank.unload(sa)
        assert bank.bytes(sa) == 0
        with pytest.raises(AdapterBankError, match="slot 0"):
            bank.set_token_adapters([sa])
        assert bank.load(lora_b) == sa            # the freed slot is reused
        out = _run(rm, [(toks, sa), (toks, sb)], bank)
    _assert_same(out[0], refs["b"], "reused slot 0 on adapter B")
    _assert_same(out[1], refs["b"], "slot 1 on adapter B")
