"""How far rounding noise reaches: the spread of the noise margin a job's guard
estimates from NULL_DRAWS null adapters, by two statistics.

    nice python bench/bench_null_margin.py --seeds 0,3,4,5 --draws 10 \
        --out bench/results/drift-null-margin-drops-2026-12-03.json

One resident default model (SmolLM2-135M Q4_1), one thread. The held-out
anchors are recorded as a job records them. For each job seed (which draws
the adapter's A, as the evaluation facts' job of bench_drift.py initializes
it) and each sigma, `--draws` null adapters, B ~ N(0, sigma^2) with draw keys
apart from the guard's own (NULL_SEED), are measured one at a time
(`DriftProbe.null_drifts(draws=1, seed=DRAW_KEYS + d)`). Each row has

- `widest`: the widest base lead (log p1 - log p2) at which that adapter moved
  the argmax (the margin's earlier statistic);
- `drop`: the widest drop of the base token's lead it made at any answer
  position (`drift.lead_drops`; the margin's statistic since), never below
  `widest`.

A job's margin is the NULL_RANK-th largest of its NULL_DRAWS such values (earlier the
largest), so the spread of
each is the spread of what a job's anchors_changed is counted against; per
seed, `guard` is the margin the job's guard itself measures (its own draws).
`--flips FILE ...` (bench_drift.py results, which keep each held-out anchor's
`flip_leads`) counts each job's changes beyond the margins of its seed.
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
from drift_steps import run_steps  # tests/drift_steps.py: bench_drift puts tests/ on sys.path

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.drift.anchors import load_anchors
from dreamstage.training.drift.measure import NULL_DRAWS, NULL_RANK, DriftProbe
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.walk.trainer import native_trainer

DRAW_KEYS = 1000      # the draws' keys start here (the guard's NULL_SEED is 7)


def spread(values) -> dict | None:
    """median, 90th percentile, max and min of `values` (None when there are none:
    fewer draws than NULL_DRAWS make no group)."""
    w = np.array(values)
    if w.size == 0:
        return None
    return {"median": float(np.median(w)), "q90": float(np.quantile(w, 0.9)), "max": float(w.max()),
            "min": float(w.min())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/drift-null-margin.json")
    ap.add_argument("--seeds", default="0,3,4,5", help="job seeds (each draws its own A)")
    ap.add_argument("--draws", type=int, default=10, help="null adapters per seed and sigma")
    ap.add_argument("--sigmas", type=float, nargs="*", default=[1e-4, 1e-3])
    ap.add_argument("--flips", nargs="*", default=[], help="bench_drift.py results whose changes to count")
    args = ap.parse_args()
    rm = ResidentModel(ResidentConfig(n_ctx=512, n_seq=1, n_threads=1))
    probe = DriftProbe(rm, load_anchors(), seq_id=0)
    run_steps(probe.record())
    rows, guards = [], {}
    for seed in (int(x) for x in args.seeds.split(",")):
        body = {"examples": chat_examples(EVAL_FACTS), "rank": 8, "targets": QV, "seed": seed}
        spec = parse_train_request(body).to_job_spec()
        trainer = native_trainer(rm, spec, spec.chunk)
        try:
            # the margin this seed's job measures (the guard's own draws, every default)
            t = time.perf_counter()
            guards[seed] = {"drop": run_steps(probe.null_margin(trainer)), "s": round(time.perf_counter() - t, 2),
                            "draws": list(probe.noise_draws)}
            print(json.dumps({"seed": seed, "guard": guards[seed]}), flush=True)
            for sigma in args.sigmas:
                for d in range(args.draws):
                    t = time.perf_counter()
                    (null,) = run_steps(probe.null_drifts(trainer, draws=1, sigma=sigma, seed=DRAW_KEYS + d))
                    rows.append({"seed": seed, "sigma": sigma, "draw": d,
                                 "widest": max((x for lead in null.flip_leads for x in lead), default=0.0),
                                 "drop": null.widest_drop, "changed_raw": null.changed_raw,
                                 "changed_beyond_guard": null.changed,       # beyond this seed's guard margin
                                 "drift_kl": round(null.drift_kl, 5),
                                 "s": round(time.perf_counter() - t, 2)})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            trainer.close()
    summary: dict = {"draws": len(rows)}
    for stat in ("widest", "drop") if rows else ():
        # what a job's margin (the NULL_RANK-th largest of NULL_DRAWS draws) comes to: disjoint groups of one
        # seed's and sigma's draws
        groups = []
        for key in sorted({(r["seed"], r["sigma"]) for r in rows}):
            one = [r[stat] for r in rows if (r["seed"], r["sigma"]) == key]
            groups += [sorted(one[i:i + NULL_DRAWS])[-NULL_RANK]
                       for i in range(0, len(one) - NULL_DRAWS + 1, NULL_DRAWS)]
        summary[stat] = {**spread([r[stat] for r in rows]), "at_least_0.5": sum(r[stat] >= 0.5 for r in rows),
                         "job_margins": spread(groups), "job_margins_of_groups": groups}
        print(json.dumps({stat: summary[stat]}), flush=True)
    jobs = []
    for f in args.flips:       # each job's changes, counted beyond its seed's guard margin
        data = json.loads(Path(f).read_text())
        for res in data["results"]:
            margin = guards.get(data["seed"], {}).get("drop")
            flips = res["flip_leads"]
            jobs.append({"file": f, "name": res["name"], "seed": data["seed"], "facts": data.get("facts", "eval"),
                         "margin_before": res.get("noise_margin"), "beyond_before": res.get("anchors_changed_count"),
                         "margin_now": margin, "raw": sum(map(bool, flips)),
                         "beyond_now": None if margin is None else sum(any(x > margin for x in lead)
                                                                       for lead in flips),
                         "leads_above_0.45": sorted(round(x, 3) for lead in flips for x in lead if x > 0.45)})
            print(json.dumps(jobs[-1]), flush=True)
    Path(args.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
        "model": rm.model_path.name, "threads": 1, "anchors": len(probe.bases), "null_draws_per_job": NULL_DRAWS,
        "guard_margins": guards, "summary": summary, "jobs": jobs, "rows": rows}, indent=1) + "\n")
    rm.close()


if __name__ == "__main__":
    main()
