"""How wide a near tie an adapter that learned nothing crosses: the spread of
the noise margin a job's guard estimates from NULL_DRAWS draws.

    nice python bench/bench_null_margin.py --seeds 0,3,4,5 --draws 10 \
        --out bench/results/drift-null-margin-2026-12-02.json

One resident default model (SmolLM2-135M Q4_1), one thread. The held-out
anchors are recorded as a job records them. For each job seed (which draws
the adapter's A, as the evaluation facts' job of bench_drift.py initializes
it) and each sigma, `--draws` null adapters, B ~ N(0, sigma^2) with draw keys
apart from the guard's own (NULL_SEED), are measured one at a time by
`DriftProbe.null_margin(draws=1)`: each row's `widest` is the widest base
lead (log p1 - log p2) at which that one adapter moved the argmax. A job's
margin is the largest of its NULL_DRAWS such values, so the spread of
`widest` is the spread of what a job's anchors_changed is counted against.
docs/architecture/drift.md ("The noise margin") reads the result.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_drift import QV
from drift_facts import EVAL_FACTS, chat_examples

from dreamstage.resident import ResidentConfig, ResidentModel
from dreamstage.training.drift import NULL_DRAWS, DriftProbe, load_anchors, run_steps
from dreamstage.training.scheduler import native_trainer
from dreamstage.training.spec import parse_train_request

DRAW_KEYS = 1000      # the draws' keys start here (the guard's NULL_SEED is 7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/drift-null-margin.json")
    ap.add_argument("--seeds", default="0,3,4,5", help="job seeds (each draws its own A)")
    ap.add_argument("--draws", type=int, default=10, help="null adapters per seed and sigma")
    ap.add_argument("--sigmas", type=float, nargs="*", default=[1e-4, 1e-3])
    args = ap.parse_args()
    rm = ResidentModel(ResidentConfig(n_ctx=512, n_seq=1, n_threads=1))
    probe = DriftProbe(rm, load_anchors(), seq_id=0)
    run_steps(probe.record())
    rows = []
    for seed in (int(x) for x in args.seeds.split(",")):
        body = {"examples": chat_examples(EVAL_FACTS), "rank": 8, "targets": QV, "seed": seed}
        spec = parse_train_request(body).to_job_spec()
        trainer = native_trainer(rm, spec, spec.chunk)
        try:
            for sigma in args.sigmas:
                for d in range(args.draws):
                    t = time.perf_counter()
                    widest = run_steps(probe.null_margin(trainer, draws=1, sigma=sigma, seed=DRAW_KEYS + d))
                    rows.append({"seed": seed, "sigma": sigma, "draw": d, "widest": widest,
                                 "s": round(time.perf_counter() - t, 2)})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            trainer.close()
    w = np.array([r["widest"] for r in rows])
    # what a job's margin (the largest of NULL_DRAWS draws) comes to: disjoint groups of one seed's and sigma's draws
    groups = []
    for key in sorted({(r["seed"], r["sigma"]) for r in rows}):
        one = [r["widest"] for r in rows if (r["seed"], r["sigma"]) == key]
        groups += [max(one[i:i + NULL_DRAWS]) for i in range(0, len(one) - NULL_DRAWS + 1, NULL_DRAWS)]
    summary = {"draws": len(w), "median": float(np.median(w)), "q90": float(np.quantile(w, 0.9)),
               "max": float(w.max()), "at_least_0.5": int((w >= 0.5).sum()),
               "margins_of_null_draws_groups": groups}
    print(json.dumps(summary), flush=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
        "model": rm.model_path.name, "threads": 1, "anchors": len(probe.bases), "null_draws_per_job": NULL_DRAWS,
        "summary": summary, "rows": rows}, indent=1) + "\n")
    rm.close()


if __name__ == "__main__":
    main()
