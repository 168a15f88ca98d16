"""What the exact walk and recompute cost: time per window and allocator memory.

For each (window, chunk) and walk in (plain, exact, exact + recompute): one
window of the default model (every token labelled, rank 8 on attn_q, attn_v,
q8_0 training cache), all of its micro-steps. Reported per run: wall time of
the window, micro-steps, and the allocator's figures from the receipts:
graph_mib (the largest graph planned in the window), context_mib, walk_mib,
adapter_mib, optimizer_mib, and the lease: what the job holds plus its largest
graph. The walks run interleaved (A B C C B A) so load drift shows as spread.

    python bench/bench_exact_walk.py --windows 1024 --chunks 128,256 --out bench/results/exact_walk.json

--memory-only measures each walk's largest graph without running its whole
window (for long windows on two cores): the plain walk trains only its last
chunk (the others run forward only, filling the cache), the exact walks stop
after their first backward chunk. Those are the chunks with the most cached
positions, so graph_mib is the window's; wall_s is then not a window's time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

WALKS = {"plain": dict(exact=False, recompute=False), "exact": dict(exact=True, recompute=False),
         "exact+recompute": dict(exact=True, recompute=True)}
TEXT = ("The dream stage trains a LoRA adapter on the resident context between decode batches. Long "
        "conversations are where it matters: every chunk's loss reaches the K/V of the chunks before it. ")


def run_window(rm, tokens, chunk, walk, cache_type, memory_only=False):
    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer
    n = len(tokens)
    mask = np.ones(n, np.uint8)
    if memory_only and walk == "plain":
        mask[:((n - 2) // chunk) * chunk + 1] = 0      # only the last chunk's rows predict a target
    with Trainer(rm, LoraConfig(), cache_type=cache_type, window=n, chunk=chunk,
                 optimizer=OptimizerConfig(lr=1e-4), **WALKS[walk]) as tr:
        t0 = time.perf_counter()
        tr.begin_window(tokens, mask)
        receipts = []
        while tr.chunks_left:
            receipts.append(tr.micro_step())
            if not receipts[-1].ok or (memory_only and receipts[-1].walk_pass == "backward"):
                break
        wall = time.perf_counter() - t0
    bad = [r.message for r in receipts if not r.ok]
    if bad:
        raise RuntimeError(bad[0])
    last = receipts[-1]
    graph = max(r.graph_mib for r in receipts)
    held = last.context_mib + last.adapter_mib + last.optimizer_mib + last.walk_mib
    return {"walk": walk, "window": n, "chunk": chunk, "wall_s": wall, "steps": len(receipts),
            "forward_steps": sum(r.walk_pass == "forward" for r in receipts),
            "graph_mib": graph, "context_mib": last.context_mib, "walk_mib": last.walk_mib,
            "adapter_mib": last.adapter_mib, "optimizer_mib": last.optimizer_mib, "lease_mib": held + graph,
            "train_tok_s": None if memory_only else n / wall, "memory_only": memory_only}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="1024")
    ap.add_argument("--chunks", default="128,256")
    ap.add_argument("--walks", default="plain,exact,exact+recompute")
    ap.add_argument("--cache-type", default="q8_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2, help="passes over the walks, alternating direction (A B C C B A)")
    ap.add_argument("--memory-only", action="store_true", help="the largest graph only (see above)")
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded default model)")
    ap.add_argument("--ngl", type=int, default=-1, help="layers on the GPU in a GPU build (-1: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from dreamstage.serving.resident import ResidentConfig, ResidentModel

    windows = [int(x) for x in args.windows.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    walks = args.walks.split(",")
    rm = ResidentModel(ResidentConfig(model_path=args.model, n_ctx=max(windows), n_seq=1, n_threads=args.threads,
                                      n_gpu_layers=args.ngl))
    text_tokens = rm.tokenize(TEXT * (max(windows) // 20 + 1))
    runs = []
    try:
        for w in windows:
            tokens = text_tokens[:w]
            for c in chunks:
                for rep in range(args.reps):
                    for walk in (walks if rep % 2 == 0 else walks[::-1]):
                        r = run_window(rm, tokens, c, walk, args.cache_type, args.memory_only)
                        r["rep"] = rep
                        runs.append(r)
                        print(json.dumps(r), flush=True)
    finally:
        rm.close()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
           "cpus": os.cpu_count(), "threads": args.threads, "load_avg": os.getloadavg(),
           "model": args.model or "SmolLM2-135M-Instruct Q4_1 (default)", "ngl": args.ngl,
           "lora": "rank 8, attn_q, attn_v",
           "context_cache_type": args.cache_type, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
