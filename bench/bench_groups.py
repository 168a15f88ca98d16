"""Shared-prefix groups against separate examples: time per group and memory.

For each (prompt P, reply length D, replies G): one group of G replies to one
prompt (the group walk, `Trainer.train_group`), side by side with the same G
examples trained as G separate windows (prompt + reply) in the exact walk,
whose gradient is the same (tests/test_groups.py). Both use the default model
(rank 8 on attn_q, attn_v), a q8_0 training cache, chunk --chunk, one thread,
one optimizer update per group (the separate windows: accumulate_windows = G).
Reported per point: wall and CPU time (this process, one thread: what the
shared machine's other load does not inflate) of each path, their ratios (separate / group),
micro-steps, the largest graph_mib and walk_mib of each, and the per-step
receipts' times (the cost model in dreamstage/training/walk/groups.py is fitted to them).

    nice python bench/bench_groups.py --out bench/results/groups.json

The separate windows of one point all have the same shape, so --separate-windows (default 2)
k < G times k of them and scales by G / k (the record says so: `separate_measured`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

PROMPT = ("The dream stage trains a LoRA adapter on the resident context between decode batches. Long "
          "conversations are where it matters: every chunk's loss reaches the K/V of the chunks before it. ")
REPLY = ("A reply is short next to its prompt, and many replies share one prompt; each has its own weight, "
         "positive or negative, like a reward or an advantage. ")


def _trainer(rm, window, chunk, accumulate, cache_type):
    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer
    return Trainer(rm, LoraConfig(), cache_type=cache_type, window=window, chunk=min(chunk, window), exact=True,
                   optimizer=OptimizerConfig(lr=1e-4, accumulate_windows=accumulate))


def _steps(receipts):
    return [{"pass": r.walk_pass, "tokens": r.chunk_tokens, "pos": r.chunk_pos, "ms": round(r.ms, 2),
             "reply": r.group_reply} for r in receipts]


def run_separate(rm, prompt, replies, window, chunk, cache_type, k):
    """k of the G separate windows (prompt + reply), timed; returns (wall scaled to G, receipts)."""
    P, G = len(prompt), len(replies)
    with _trainer(rm, window, chunk, G, cache_type) as tr:
        t0, c0 = time.perf_counter(), time.process_time()
        receipts = []
        for toks, mask, _ in replies[:k]:
            tr.begin_window(np.concatenate([prompt, toks]), np.concatenate([np.zeros(P, np.uint8), mask]))
            while tr.chunks_left:
                receipts.append(tr.micro_step())
                if not receipts[-1].ok:
                    raise RuntimeError(receipts[-1].message)
        return (time.perf_counter() - t0) * G / k, (time.process_time() - c0) * G / k, receipts


def run_point(rm, prompt, replies, chunk, cache_type, separate_windows, one_chunk):
    P, G = len(prompt), len(replies)
    window = P + max(len(t) for t, _, _ in replies)
    out = {"P": P, "D": len(replies[0][0]), "G": G, "chunk": chunk}
    with _trainer(rm, window, chunk, 1, cache_type) as tr:
        t0, c0 = time.perf_counter(), time.process_time()
        receipts = tr.train_group(prompt, replies)
        out["group_s"], out["group_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        bad = [r.message for r in receipts if not r.ok]
        if bad:
            raise RuntimeError(bad[0])
        out.update(group_steps=len(receipts), group_graph_mib=max(r.graph_mib for r in receipts),
                   group_walk_mib=receipts[-1].walk_mib, group_step_log=_steps(receipts))
    k = min(G, separate_windows) if separate_windows > 0 else G
    wall, cpu, receipts = run_separate(rm, prompt, replies, window, chunk, cache_type, k)
    out.update(separate_s=wall, separate_cpu_s=cpu, separate_measured=k, separate_steps=len(receipts) * G // k,
               separate_graph_mib=max(r.graph_mib for r in receipts), separate_walk_mib=receipts[-1].walk_mib,
               separate_step_log=_steps(receipts))
    out["speedup"] = out["separate_s"] / out["group_s"]
    out["speedup_cpu"] = out["separate_cpu_s"] / out["group_cpu_s"]
    if one_chunk:
        # the strongest separate path with the same gradient: each window in one graph (more memory)
        wall, cpu, receipts = run_separate(rm, prompt, replies, window, window, cache_type, k)
        out.update(one_chunk_s=wall, one_chunk_cpu_s=cpu, one_chunk_graph_mib=max(r.graph_mib for r in receipts),
                   speedup_vs_one_chunk=wall / out["group_s"], speedup_cpu_vs_one_chunk=cpu / out["group_cpu_s"])
    from dreamstage.training.walk.groups import group_steps, predicted_ms, prefer_group, separate_steps
    lens = [len(t) for t, _, _ in replies]
    out.update(predicted_group_ms=predicted_ms(group_steps(P, lens, chunk)),
               predicted_separate_ms=predicted_ms(separate_steps(P, lens, chunk, exact=True)),
               picks_group=prefer_group(P, lens, chunk, exact=True), group_was_faster=out["speedup_cpu"] > 1)
    return out


def table(path: str) -> str:
    """The markdown table of docs/benchmarks.md from a result file."""
    d = json.loads(Path(path).read_text())
    rows = ["| P | D | G | group s (cpu) | separate s (cpu) | speedup cpu (wall) | steps group / separate | "
            "graph_mib group / separate | walk_mib | cost model picks | right |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        pick = "group" if r["picks_group"] else "separate"
        right = "yes" if r["picks_group"] == (r["speedup_cpu"] > 1) else "**no**"
        rows.append(f"| {r['P']} | {r['D']} | {r['G']} | {r['group_s']:.1f} ({r['group_cpu_s']:.1f}) | "
                    f"{r['separate_s']:.1f} ({r['separate_cpu_s']:.1f}) | **{r['speedup_cpu']:.2f}x** "
                    f"({r['speedup']:.2f}x) | {r['group_steps']} / {r['separate_steps']} | "
                    f"{r['group_graph_mib']:.0f} / {r['separate_graph_mib']:.0f} | {r['group_walk_mib']:.1f} | "
                    f"{pick} (predicted {r['predicted_separate_ms'] / r['predicted_group_ms']:.2f}x) | {right} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="128,512,2048")
    ap.add_argument("--replies", default="8,32")
    ap.add_argument("--groups", default="4,8,16")
    ap.add_argument("--extra", default="512:16:8,128:8:1,512:16:1,16:32:4",
                    help="more P:D:G points (the target point; where it loses: G = 1, short prompts)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--cache-type", default="q8_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--separate-windows", type=int, default=2, help="time k separate windows, scale by G/k (0: all G)")
    ap.add_argument("--one-chunk", default="512:16:8",
                    help="P:D:G points also timed against one-chunk separate windows")
    ap.add_argument("--skip", default="", help="P:D:G points to leave out, comma separated")
    ap.add_argument("--warmup", action="store_true",
                    help="run the first point once untimed first (a GPU's first graphs and kernels load slowly)")
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded default model)")
    ap.add_argument("--ngl", type=int, default=-1, help="layers on the GPU in a GPU build (-1: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None, help="print the markdown table of a result file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    from dreamstage.serving.resident import ResidentConfig, ResidentModel

    points = [(p, d, g) for p in map(int, args.prompts.split(",")) for d in map(int, args.replies.split(","))
              for g in map(int, args.groups.split(","))]
    points += [tuple(map(int, x.split(":"))) for x in args.extra.split(",") if x]
    skip = {tuple(map(int, x.split(":"))) for x in args.skip.split(",") if x}
    one_chunk = {tuple(map(int, x.split(":"))) for x in args.one_chunk.split(",") if x}
    points = [pt for pt in points if pt not in skip]
    longest = max(p + d for p, d, _ in points)
    rm = ResidentModel(ResidentConfig(model_path=args.model, n_ctx=longest, n_seq=1, n_threads=args.threads,
                                      n_gpu_layers=args.ngl))
    prompt_all = np.asarray(rm.tokenize(PROMPT * (longest // 20 + 1)), np.int32)
    reply_all = np.asarray(rm.tokenize(REPLY * 40, add_special=False), np.int32)
    weights = [1.0, -0.5, 0.75, 1.5, -1.0, 0.25, 2.0, -0.25]
    runs = []
    t_start = time.time()
    from dreamstage.training.walk.groups import DEFAULT_COST, fit_cost
    try:
        for i, (P, D, G) in enumerate(points[:1] * args.warmup + points):
            prompt = prompt_all[:P]
            replies = [(reply_all[7 * g:7 * g + D], np.ones(D, np.uint8), weights[g % len(weights)]) for g in range(G)]
            r = run_point(rm, prompt, replies, args.chunk, args.cache_type, args.separate_windows,
                          (P, D, G) in one_chunk)
            if args.warmup and i == 0:
                continue
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if not k.endswith("step_log")}), flush=True)
    finally:
        rm.close()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
           "cpus": os.cpu_count(), "threads": args.threads, "load_avg": os.getloadavg(),
           "wall_s": time.time() - t_start, "ngl": args.ngl,
           "model": args.model or "SmolLM2-135M-Instruct Q4_1 (default)",
           "lora": "rank 8, attn_q, attn_v", "context_cache_type": args.cache_type, "chunk": args.chunk,
           "skipped": sorted(skip), "cost_model": vars(DEFAULT_COST),
           "cost_fitted": vars(fit_cost([s for r in runs for s in r["group_step_log"] + r["separate_step_log"]])),
           "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
