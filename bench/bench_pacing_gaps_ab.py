"""A/B of one pacing rule on one load shape: the pacer's gaps-first rule
(`--rule gaps`, pacing._gap_reserve) or the shaper's kept chunk (`--rule keep`,
StepShaper.keep_chunk: the plain walk's chunk is never cut, the deadline alone
bounds the pause; off, the shaper cuts chunks to the bound).

(A second rule, the shaper's whole-tail noise room on an oversubscribed
machine, was measured with this script's `--rule noise` at commit fd73f86 and
not kept: bench/results/dream-pacing-noise-ab-2026-12-01-loaded.json.)

One server, the chat clients in its process (in their own with
--clients-apart for the job's segments too). After a first job has recorded
the drift anchors (so no segment pays for that), each repetition runs the rule
on, then off: a segment without a job and one with a job, as
bench_dream_pacing.py does. Switching the rule off sets RECUR_WINDOW_S below zero,
so no gap ever counts as recent and nothing is reserved; switching the kept
chunk off makes the scheduler's shapers with `keep_chunk=False`. The server
runs in this process, so the switch reaches the next job's pacer.

    .venv/bin/python bench/bench_pacing_gaps_ab.py --shape 1x24 --seconds 20 --reps 3 \
        --out bench/results/dream-pacing-gaps-ab-2026-11-30.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dream_pacing as pacing_bench

from dreamstage.training.jobs import scheduler
from dreamstage.training.pacing.pacer import pacer as pacing
from dreamstage.training.pacing.shaper import StepShaper

PACING = {"max_slowdown": 0.10, "max_pause_ms": 250}
KEEP = {"on": True}


class _SwitchedShaper(StepShaper):
    """The scheduler's shaper, its kept chunk switched by KEEP (--rule keep)."""

    def __init__(self, *args, keep_chunk: bool = False, **kwargs):
        super().__init__(*args, keep_chunk=keep_chunk and KEEP["on"], **kwargs)


def switch(which: str, on: bool) -> None:
    if which == "gaps":
        pacing.RECUR_WINDOW_S = 5.0 if on else -1.0
    else:
        KEEP["on"] = on


def one(srv, http, shape, seconds: float, which: str, rule: str, rep: int) -> dict:
    switch(which, rule == "on")
    base = pacing_bench.load_apart(srv.url, shape, seconds)
    job = pacing_bench.with_job(srv, http, shape, seconds, PACING)
    p, j = job["pacer"], job["job"]
    return {"rep": rep, "rule": rule, "base_tok_s": base["tok_s"], "with_tok_s": job["client"]["tok_s"],
            "client_slowdown": 1 - job["client"]["tok_s"] / base["tok_s"], "pacer_slowdown": p["realized_slowdown"],
            "share_vs_allowed": j["share_vs_allowed"], "dream_s": p["dream_s"], "dream_idle_s": p["dream_idle_s"],
            "wall_s": p["wall_s"], "active_s": p["active_s"], "steps": p["micro_steps"],
            "idle_steps": p["idle_micro_steps"], "collisions": p["idle_collisions"],
            "pause_ms_p50": p["micro_step_ms_p50"], "pause_ms_p95": p["micro_step_ms_p95"],
            "pause_ms_max": p["micro_step_ms_max"], "pauses_over_max": p["pauses_over_max"],
            "step_chunk": p.get("step_chunk"), "step_noise": p.get("step_noise"),
            "chunk_kept": p.get("chunk_kept"), "steps_stopped": p.get("steps_stopped"),
            "dream_threads": p.get("dream_threads"), "pause_overhead_ms_p95": p.get("pause_overhead_ms_p95"),
            "step_deadline_ms": p.get("step_deadline_ms"), "native_step_ms": job["native_step_ms"],
            "stopped": job["stopped"],
            "walked_tok_s_wall": j["walked_tok_s_wall"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rule", default="gaps", choices=("gaps", "keep"))
    ap.add_argument("--shape", default="1x24", choices=sorted(pacing_bench.SHAPES))
    ap.add_argument("--clients-apart", action="store_true", help="the job segments' clients in their own process too")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shape = pacing_bench.SHAPES[args.shape]
    scheduler.StepShaper = _SwitchedShaper
    if args.clients_apart:
        pacing_bench.LOAD["load"] = pacing_bench.load_apart
    rows = []
    with tempfile.TemporaryDirectory() as state:
        settings = pacing_bench.ServerSettings(ctx=4096, parallel=8, threads=args.threads, state_dir=state)
        with pacing_bench.BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
            pacing_bench.load(srv.url, pacing_bench.SHAPES["2"], 3.0)            # warm-up
            first = http.post("/train", json={"text": pacing_bench.LESSON, "window": 64, "chunk": 64, "epochs": 1,
                                              "promote": "never"}).json()
            while http.get(f"/train/{first['id']}").json()["state"] not in ("done", "error", "cancelled"):
                time.sleep(0.5)                                                 # the anchors are recorded
            for rep in range(args.reps):
                for rule in ("on", "off"):
                    rows.append(one(srv, http, shape, args.seconds, args.rule, rule, rep))
                    print(json.dumps(rows[-1]), flush=True)
    mean = {rule: {k: sum(r[k] for r in rows if r["rule"] == rule) / args.reps
                   for k in ("client_slowdown", "pacer_slowdown", "share_vs_allowed", "dream_s", "walked_tok_s_wall",
                             "pause_ms_p95", "pauses_over_max", "steps")}
            for rule in ("on", "off")}
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "rule": args.rule, "shape": shape.name,
                                          "seconds_per_segment": args.seconds,
                                          "clients_apart": args.clients_apart, "load_average_at_end": os.getloadavg(),
                                          "pacing": PACING, "rows": rows, "mean": mean}, indent=2) + "\n")
    print(json.dumps(mean, indent=2))


if __name__ == "__main__":
    main()
