"""What splitting the resident model across RPC workers costs, on loopback.

Two `dreamstage rpc-worker` processes (one thread each) on this host hold the
default model's layers past the first quarter and its output head (-ngl, an
even --tensor-split); this process's CPU holds the embeddings and the first
layers. The same model also loads alone in this process. For each: greedy
decode tok/s (one token a llama_decode after a short prompt) and dream
micro-step train tok/s (a window of one chunk, every token a loss token, LoRA
rank 8 on attn_q,attn_v of every layer, f32 training cache), with the bytes
that crossed the wire per decoded token and per micro-step. The two set-ups
alternate, rep by rep, so a shared machine's load drifts over both. Writes
bench/results/rpc-<date>.json.

    python bench/bench_rpc.py [--reps 3] [--chunk 64] [--decode 32]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dreamstage.serving import rpc
from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer

TEXT = ("Between decode batches the resident model takes one training micro-step on the text it was asked "
        "to learn, and the served adapter moves only when the engine promotes it. ")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(n: int) -> tuple[list[subprocess.Popen], tuple[str, ...]]:
    ports = [_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "dreamstage", "rpc-worker", "--port", str(p), "--threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    for p in ports:
        while rpc.probe(rpc.Endpoint("127.0.0.1", p), timeout_s=0.5):
            time.sleep(0.2)
    return procs, tuple(f"127.0.0.1:{p}" for p in ports)


def decode_rate(rm: ResidentModel, prompt: list[int], n: int) -> tuple[float, float]:
    """Greedy decode tok/s after the prompt, and the wire bytes per decoded token."""
    lc = rm.lc
    lc.llama_memory_clear(rm.memory, True)
    rm.decode_entries([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    tok = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(rm.ctx, len(prompt) - 1), shape=(rm.n_vocab,)).argmax())
    b0, t0 = rpc.traffic().bytes, time.perf_counter()
    for i in range(n):
        rm.decode_entries([(tok, len(prompt) + i, 0, True)])
        tok = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(rm.ctx, 0), shape=(rm.n_vocab,)).argmax())
    return n / (time.perf_counter() - t0), (rpc.traffic().bytes - b0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    procs, endpoints = start_workers(2)
    try:
        cfg = dict(n_ctx=512, n_seq=1, n_threads=args.threads, kv_type="f32")
        single = ResidentModel(ResidentConfig(**cfg))
        n_layer = single.lc.llama_model_n_layer(single.model)
        ngl = n_layer - n_layer // 4            # the first quarter stays here, the rest and the head go out
        split = ResidentModel(ResidentConfig(**cfg, rpc=endpoints, n_gpu_layers=ngl, tensor_split=(1.0, 1.0)))
        tokens = single.tokenize(TEXT * 40)
        c = args.chunk
        lora = LoraConfig(targets="attn_q,attn_v")
        trainers = {name: Trainer(rm, lora, cache_type="f32", window=c, chunk=c, optimizer=OptimizerConfig(lr=1e-4))
                    for name, rm in (("single", single), ("split", split))}
        models = {"single": single, "split": split}
        samples: dict[str, list[dict]] = {k: [] for k in models}
        for t in trainers.values():              # warm-up: the first step grows the compute buffers
            t.train_window(tokens[:c], np.ones(c, np.uint8))
        for _ in range(args.reps):
            for name in ("single", "split", "split", "single"):
                (r,) = trainers[name].train_window(tokens[:c], np.ones(c, np.uint8))
                assert r.ok, r.message
                tok_s, wire = decode_rate(models[name], tokens[:16], args.decode)
                samples[name].append({"step_ms": r.ms, "rpc_bytes_per_step": r.rpc_bytes, "decode_tok_s": tok_s,
                                      "rpc_bytes_per_token": wire})
        out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": f"{platform.node()} {os.cpu_count()} cores",
               "load_avg_1m": os.getloadavg()[0], "threads": args.threads, "worker_threads": 1,
               "model": single.model_path.name, "n_layer": n_layer, "split": f"layers 0-{n_layer - ngl - 1} here, "
               f"the rest and the output head over 2 loopback workers (-ngl {ngl}, --tensor-split 1,1)",
               "chunk": c, "targets": lora.targets, "rank": lora.rank, "cache": "f32", "results": {}}
        for name, s in samples.items():
            ms = statistics.median(x["step_ms"] for x in s)
            out["results"][name] = {
                "n": len(s), "train_step_ms_median": ms, "train_tok_s": c / (ms / 1000),
                "decode_tok_s_median": statistics.median(x["decode_tok_s"] for x in s),
                "rpc_bytes_per_step_median": statistics.median(x["rpc_bytes_per_step"] for x in s),
                "rpc_bytes_per_decoded_token_median": statistics.median(x["rpc_bytes_per_token"] for x in s)}
        for t in trainers.values():
            t.close()
        split.close()
        single.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    path = Path(args.out or Path(__file__).resolve().parent / "results" / f"rpc-cpu-{time.strftime('%Y-%m-%d')}.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["results"], indent=2))


if __name__ == "__main__":
    main()
