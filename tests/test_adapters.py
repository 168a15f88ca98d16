"""Adapter files: the shadow saved as a standard GGUF LoRA loads in stock
llama.cpp (llama_adapter_lora_init) and in llama-cpp-python (lora_path), and
their logits match the dream stage's served adapter."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from trainer_testing import ProbedTrainer as Trainer

from dreamstage.adapters.files import load_lora, save_lora
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig

PROMPT = "Adapters are saved atomically in the standard format."


@pytest.fixture(scope="module")
def rm(dream_resident):
    return dream_resident


@pytest.fixture(scope="module")
def trained(rm, tmp_path_factory):
    """A trainer whose shadow moved for a few windows (B != 0), promoted, and its file."""
    toks = rm.tokenize("The dream stage learns this sentence by heart. " * 3)[:32]
    tr = Trainer(rm, LoraConfig(rank=4, alpha=8, targets="attn_q,attn_v,ffn_down", top_layers=3, seed=5),
                 cache_type="q8_0", window=32, chunk=32, optimizer=OptimizerConfig(lr=5e-3))
    for _ in range(3):
        assert all(r.ok for r in tr.train_window(toks, np.ones(len(toks), np.uint8)))
    assert tr.promote() == 1
    path = tmp_path_factory.mktemp("adapters") / "dream.gguf"
    tr.save(path)
    yield tr, path
    tr.close()


def _last_logits(rm, tokens) -> np.ndarray:
    lc = rm.lc
    lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)
    b = lc.llama_batch_init(len(tokens), 0, 1)
    try:
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, i == len(tokens) - 1
            b.seq_id[i][0] = 0
        assert lc.llama_decode(rm.ctx, b) == 0
        out = np.ctypeslib.as_array(lc.llama_get_logits_ith(rm.ctx, len(tokens) - 1), shape=(rm.n_vocab,)).copy()
    finally:
        lc.llama_batch_free(b)
        lc.llama_memory_seq_rm(rm.memory, 0, -1, -1)
    return out


def _set_adapters(rm, adapters):
    lc = rm.lc
    addrs = [a if isinstance(a, int) else ctypes.cast(a, ctypes.c_void_p).value for a in adapters]
    arr = (ctypes.c_void_p * max(len(addrs), 1))(*addrs)
    scales = (ctypes.c_float * max(len(adapters), 1))(*([1.0] * len(adapters)))
    rc = lc.llama_set_adapters_lora(rm.ctx, ctypes.cast(arr, ctypes.POINTER(lc.llama_adapter_lora_p_ctypes)),
                                    len(adapters), scales)
    assert rc == 0


def test_file_layout_round_trips(trained):
    tr, path = trained
    factors, alpha = load_lora(path)
    assert alpha == 8.0
    assert sorted(factors) == sorted((p.layer, p.target) for p in tr.pairs)
    np.testing.assert_array_equal(np.concatenate([x.ravel() for p in tr.pairs for x in factors[(p.layer, p.target)]]),
                                  tr.lora_parameters().astype(np.float32))
    import gguf
    r = gguf.GGUFReader(str(path))
    assert r.get_field("general.type").contents() == "adapter"
    assert r.get_field("adapter.type").contents() == "lora"
    assert r.get_field("general.architecture").contents() == "llama"
    names = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    p = tr.pairs[0]
    # GGUF ne order: lora_a [n_in, rank], lora_b [rank, n_out] (what llama-adapter.cpp checks)
    assert names[f"blk.{p.layer}.{p.target}.weight.lora_a"] == [p.n_in, 4]
    assert names[f"blk.{p.layer}.{p.target}.weight.lora_b"] == [4, p.n_out]
    assert not [f for f in os.listdir(path.parent) if f.endswith(".tmp")]


def test_load_restores_the_shadow(rm, trained):
    tr, path = trained
    with Trainer(rm, tr.lora, window=32, chunk=32) as fresh:
        assert not np.array_equal(fresh.lora_parameters(), tr.lora_parameters())
        fresh.load(path)
        np.testing.assert_array_equal(fresh.lora_parameters(), tr.lora_parameters())
    with Trainer(rm, LoraConfig(rank=4, alpha=8, targets="attn_q", top_layers=3), window=32, chunk=32) as other:
        with pytest.raises(ValueError, match="does not adapt"):
            other.load(path)


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not"):
        save_lora(tmp_path / "x.gguf", {(0, "attn_q"): (np.zeros((4, 8)), np.zeros((8, 3)))},
                  alpha=8, model_arch="llama")
    assert not list(tmp_path.iterdir())


def test_stock_loader_logits_match_the_served_adapter(rm, trained):
    tr, path = trained
    toks = rm.tokenize(PROMPT)
    base = _last_logits(rm, toks)
    tr.apply_served()
    ours = _last_logits(rm, toks)
    loaded = rm.lc.llama_adapter_lora_init(rm.model, str(path).encode())
    assert loaded, "llama_adapter_lora_init refused the file"
    try:
        _set_adapters(rm, [loaded])
        stock = _last_logits(rm, toks)
    finally:
        _set_adapters(rm, [])
        rm.lc.llama_adapter_lora_free(loaded)
    assert np.abs(ours - base).max() > 1e-2          # the adapter changes the output
    np.testing.assert_allclose(stock, ours, rtol=0, atol=1e-4)


def test_llama_cpp_python_lora_path_logits_match(rm, trained):
    tr, path = trained
    from dreamstage import native
    llama_cpp = native.llama_cpp()
    toks = rm.tokenize(PROMPT)
    tr.apply_served()
    ours = _last_logits(rm, toks)
    _set_adapters(rm, [])
    # flash attention on, as the resident context's "auto" resolves on CPU
    # (off there gives logits up to 0.46 apart even without an adapter)
    llm = llama_cpp.Llama(model_path=str(rm.model_path), lora_path=str(path), n_ctx=128, n_threads=1,
                          logits_all=True, verbose=False, seed=0, flash_attn=True)
    try:
        llm.eval(toks)
        theirs = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    finally:
        llm.close()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)


def test_adapter_directories_are_owner_only_new_and_old(tmp_path):
    """A save makes its missing directories 0700 (as the state directory and the
    database are private); a store opened on an older state directory closes the
    adapter directories it made with the umask's mode."""
    import stat

    from dreamstage.adapters.files import atomic_file
    from dreamstage.training.jobs.store import JobStore

    mode = lambda p: stat.S_IMODE(p.stat().st_mode)   # noqa: E731
    target = tmp_path / "state" / "adapters" / "notes" / "v1.gguf"
    with atomic_file(target) as tmp:
        tmp.write_bytes(b"x")
    assert target.read_bytes() == b"x"
    assert [oct(mode(d)) for d in (target.parent, target.parent.parent, tmp_path / "state")] == ["0o700"] * 3
    old = tmp_path / "old"
    (old / "adapters" / "facts").mkdir(parents=True, mode=0o755)
    (old / "adapters").chmod(0o755)
    (old / "adapters" / "facts").chmod(0o755)
    JobStore(old).close()
    assert mode(old / "adapters") == mode(old / "adapters" / "facts") == 0o700
