"""How long does one dream micro-step take on the default model, per chunk size?

For chunk in (64, 128, 256): a window of exactly one chunk, every token a loss
token, LoRA rank 8 on attn_q,attn_v of every layer (the defaults), q8_0
training cache. Each process start warms up once, then times `--reps`
micro-steps (each a whole window: forward, backward, AdamW), each followed by
the same window without loss tokens (forward only, the training graph's
forward cost). Runs the chunk
sizes interleaved (A B C C B A) so drift in a shared machine's load spreads
evenly. Writes bench/results/dream_step.json.

    .venv/bin/python bench/bench_dream_step.py [--reps 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from machine import describe

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer

TEXT = ("Between decode batches the resident model takes one training micro-step on the text it was asked "
        "to learn, and the served adapter moves only when the engine promotes it. ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunks", default="64,128,256")
    ap.add_argument("--targets", default="attn_q,attn_v")
    ap.add_argument("--top-layers", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "dream_step.json"))
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    rm = ResidentModel(ResidentConfig(n_ctx=1024, n_seq=1, n_threads=args.threads))
    tokens = rm.tokenize(TEXT * 40)
    trainers = {c: Trainer(rm, LoraConfig(targets=args.targets, top_layers=args.top_layers), cache_type="q8_0",
                           window=c, chunk=c, optimizer=OptimizerConfig(lr=1e-4)) for c in chunks}
    samples: dict[int, list[dict]] = {c: [] for c in chunks}
    for c in chunks:  # warm-up: the first step grows the compute buffer
        trainers[c].train_window(tokens[:c], np.ones(c, np.uint8))
    order = chunks + chunks[::-1]
    for _ in range(args.reps):
        for c in order:
            t0 = time.perf_counter()
            (r,) = trainers[c].train_window(tokens[:c], np.ones(c, np.uint8))
            wall = (time.perf_counter() - t0) * 1000
            assert r.ok, r.message
            (f,) = trainers[c].train_window(tokens[:c], np.zeros(c, np.uint8))   # forward only
            samples[c].append({"ms": r.ms, "wall_ms": wall, "graph_mib": r.graph_mib, "loss": r.loss,
                               "forward_only_ms": f.ms})
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": describe(),   # its load_1m: the load at the end
           "threads": args.threads, "model": rm.model_path.name,
           "targets": args.targets, "rank": 8, "top_layers": args.top_layers or "all", "cache": "q8_0", "results": {}}
    for c in chunks:
        ms = [s["ms"] for s in samples[c]]
        med = statistics.median(ms)
        fwd = statistics.median(s["forward_only_ms"] for s in samples[c])
        out["results"][str(c)] = {"n": len(ms), "ms_median": med, "ms_min": min(ms), "ms_max": max(ms),
                                  "train_tok_s": c / (med / 1000), "forward_only_ms_median": fwd,
                                  "forward_only_tok_s": c / (fwd / 1000), "graph_mib": samples[c][0]["graph_mib"],
                                  "context_mib": trainers[c].init_receipt.context_mib,
                                  "adapter_mib": trainers[c].init_receipt.adapter_mib}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["results"], indent=2))
    for t in trainers.values():
        t.close()
    rm.close()


if __name__ == "__main__":
    main()
