"""How long is one dream micro-step on 1 thread against all cores, per chunk size?

The pause shaper (dreamstage/training/pacing/shaper.py) starts the dream step on one thread
and probes more only when the load average leaves cores free. This is the
measurement behind that: on a machine shared with other programs, ggml's
workers spin at a barrier after every graph node, and a worker that lost
its core stalls the others.

    .venv/bin/python bench/bench_dream_threads.py [--reps 3] [--rounds 2] [--chunks 1,4,16]

A Trainer on the resident context (default model, window 64, rank 8 on
attn_q,attn_v), thread counts interleaved per round (all cores, then 1),
`reps` micro-steps per (threads, chunk) cell; the receipt's native `ms`.
Writes bench/results/dream-threads-<date>.json with the load average.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path

import numpy as np

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.walk.trainer import LoraConfig, Trainer

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
TEXT = "The quick brown fox jumps over the lazy dog. " * 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunks", default="1,4,16")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    rm = ResidentModel(ResidentConfig(n_ctx=1024, n_seq=2))
    lc, ctx = rm.lc, rm.ctx
    cores = int(lc.llama_n_threads_batch(ctx))
    tokens = np.array(rm.tokenize(TEXT, add_special=True, parse_special=False)[:64])
    mask = np.ones_like(tokens)
    mask[0] = 0
    trainer = Trainer(rm, LoraConfig(), window=64, chunk=chunks[0])
    cells: dict[str, list[float]] = {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for threads in (cores, 1):
            lc.llama_set_n_threads(ctx, threads, threads)
            for chunk in chunks:
                trainer.set_chunk(chunk)
                trainer.begin_window(tokens, mask)
                for _ in range(args.reps):
                    r = trainer.micro_step()
                    cells.setdefault(f"threads={threads} chunk={chunk}", []).append(r.ms)
                    if not trainer.chunks_left:
                        trainer.begin_window(tokens, mask)
    trainer.close()
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "cores_configured": cores,
              "ms": {k: {"min": min(v), "median": float(np.median(v)), "max": max(v), "all": v}
                     for k, v in cells.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"dream-threads-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for k, v in result["ms"].items():
        print(f"{k:22s} median {v['median']:7.0f} ms  (min {v['min']:.0f}, max {v['max']:.0f})")
    print(f"load average {load_before} -> {result['load_average_after']}; wrote {path}")


if __name__ == "__main__":
    main()
