"""Decode with many adapters in one batch (the adapter bank) on the CPU, against one adapter and the base.

The question (issue 46, "Measure"): with S streams decoding together, what does
putting every stream on its own adapter cost against every stream on one
adapter set on the whole context (today's serving) and against the base model?

    .venv/bin/python bench/bench_adapter_mix.py [--streams 4 8] [--ranks 8] [--targets qv all]
                                                [--reps 3] [--decode 32] [--threads 2]

For each rank x target set, S random LoRAs (B != 0) are written and loaded
into an AdapterBank; each rep then times, in turn, S streams (a 32-token
prompt each in one batch, then `--decode` batches of one token per stream):
  base       no adapter;
  one        adapter 0 on the context (llama_set_adapters_lora);
  bank_one   the bank armed with every stream on slot 0;
  mixed      the bank armed with stream s on slot s.
Medians over reps; cost_mixed_vs_one = 1 - mixed / one. Writes
bench/results/adapter-mix-cpu-<date>.json. The GPU twin is
bench/gpu/dream_bank_bench.cpp (bench/gpu/bank.sh).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGETS = {"qv": ["attn_q", "attn_v"],
           "all": ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]}
PROMPT_TOKENS = 32


def write_lora(rm, path: Path, rank: int, targets: list[str], seed: int) -> Path:
    from dreamstage.adapters.files import save_lora
    lc, m = rm.lc, rm.model
    n_embd = rm.n_embd
    n_kv = n_embd // lc.llama_model_n_head(m) * lc.llama_model_n_head_kv(m)
    n_ff = int(rm.meta(f"{rm.meta('general.architecture')}.feed_forward_length"))
    dims = {"attn_q": (n_embd, n_embd), "attn_output": (n_embd, n_embd), "attn_k": (n_embd, n_kv),
            "attn_v": (n_embd, n_kv), "ffn_gate": (n_embd, n_ff), "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd)}
    rng = np.random.default_rng(seed)
    factors = {}
    for layer in range(lc.llama_model_n_layer(m)):
        for t in targets:
            n_in, n_out = dims[t]
            factors[(layer, t)] = (rng.uniform(-1, 1, (rank, n_in)) / np.sqrt(n_in), rng.normal(0, 0.02, (n_out, rank)))
    return save_lora(path, factors, alpha=2.0 * rank, model_arch=rm.meta("general.architecture") or "llama")


def streams_tok_s(rm, bank, slots: list[int] | None, n_decode: int) -> float:
    """S streams (S = len(slots)); slots None: no bank. Decode tok/s over the n_decode steps."""
    lc = rm.lc
    S = len(slots) if slots is not None else 0
    lc.llama_memory_seq_rm(rm.memory, -1, -1, -1)
    rng = np.random.default_rng(3)
    entries, tok_slots = [], []
    for s in range(S):
        toks = rng.integers(0, rm.n_vocab, PROMPT_TOKENS)
        entries += [(int(t), i, s, i == PROMPT_TOKENS - 1) for i, t in enumerate(toks)]
        tok_slots += [slots[s]] * PROMPT_TOKENS
    if bank is not None:
        bank.set_token_adapters(tok_slots)
    rm.decode_entries(entries)
    t0 = time.perf_counter()
    for step in range(n_decode):
        nxt = []
        for s in range(S):
            row = lc.llama_get_logits_ith(rm.ctx, (s + 1) * PROMPT_TOKENS - 1 if step == 0 else s)
            nxt.append(int(np.argmax(np.ctypeslib.as_array(row, shape=(rm.n_vocab,)))))
        if bank is not None:
            bank.set_token_adapters(slots)
        rm.decode_entries([(nxt[s], PROMPT_TOKENS + step, s, True) for s in range(S)])
    dt_s = time.perf_counter() - t0
    if bank is not None:
        bank.set_token_adapters([])
    return S * n_decode / dt_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8])
    ap.add_argument("--targets", nargs="+", default=["qv", "all"], choices=sorted(TARGETS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from dreamstage.adapters.bank import BASE, AdapterBank
    from dreamstage.serving.resident import ResidentConfig, ResidentModel

    max_s = max(args.streams)
    rm = ResidentModel(ResidentConfig(n_ctx=max_s * 128, n_seq=max_s, n_batch=max_s * PROMPT_TOKENS,
                                      n_threads=args.threads))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.ranks:
            for tname in args.targets:
                files = [write_lora(rm, Path(tmp) / f"{tname}-r{rank}-{i}.gguf", rank, TARGETS[tname], 100 + i)
                         for i in range(max_s)]
                lc = rm.lc
                one = lc.llama_adapter_lora_init(rm.model, str(files[0]).encode())
                with AdapterBank(rm, max_s, max_rank=rank) as bank:
                    slots = [bank.load(f) for f in files]
                    for S in args.streams:
                        t: dict[str, list[float]] = {"base": [], "one": [], "bank_one": [], "mixed": []}
                        for rep in range(args.reps + 1):          # rep 0: warm-up
                            got = {"base": streams_tok_s(rm, None, [BASE] * S, args.decode)}
                            arr = (lc.llama_adapter_lora_p_ctypes * 1)(one)
                            lc.llama_set_adapters_lora(rm.ctx, arr, 1, (ctypes.c_float * 1)(1.0))
                            got["one"] = streams_tok_s(rm, None, [BASE] * S, args.decode)
                            lc.llama_set_adapters_lora(rm.ctx, None, 0, None)
                            got["bank_one"] = streams_tok_s(rm, bank, [slots[0]] * S, args.decode)
                            got["mixed"] = streams_tok_s(rm, bank, slots[:S], args.decode)
                            if rep:
                                for k, v in got.items():
                                    t[k].append(v)
                        med = {k: statistics.median(v) for k, v in t.items()}
                        run = {"rank": rank, "targets": tname, "streams": S,
                               **{f"tok_s_{k}": round(v, 1) for k, v in med.items()},
                               "cost_mixed_vs_one": round(1 - med["mixed"] / med["one"], 4),
                               "cost_one_vs_base": round(1 - med["one"] / med["base"], 4),
                               "slot_mib": round(bank.bytes(0) / 2**20, 3),
                               "all": {k: [round(x, 1) for x in v] for k, v in t.items()}}
                        print(json.dumps(run), flush=True)
                        runs.append(run)
                lc.llama_adapter_lora_free(one)
    rm.close()
    out = {"bench": "adapter mix, CPU", "model": str(rm.model_path.name), "threads": args.threads,
           "decode_steps": args.decode, "reps": args.reps, "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "date": dt.date.today().isoformat(), "runs": runs}
    path = args.out or RESULTS / f"adapter-mix-cpu-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
