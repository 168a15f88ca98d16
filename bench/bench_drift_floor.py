"""How many held-out anchors' greedy answers change under a perturbation that
learned nothing, against its drift_kl: the floor under `anchors_changed`.

    nice python bench/bench_drift_floor.py [--out bench/results/drift-floor-2026-12-01.json]
    nice python bench/bench_drift_floor.py --model /tmp/smol-f32.gguf --no-trained-job \
        --out bench/results/drift-floor-f32-2026-12-02.json          # bench/dequantize_gguf.py wrote the copy

One resident default model (SmolLM2-135M Q4_1), one thread. The held-out
anchors' base answers are recorded as a job records them; then a rank-8
adapter on `attn_q,attn_v` (the default) gets its A as a job initializes it
and its B drawn from N(0, sigma^2), for a range of sigma and three seeds, and
each is measured exactly as a job's final drift measurement is (drift_kl,
anchors_changed, the first changed token's position, and whether the base's
top token had probability >= 0.5 there). Nothing is trained: whatever changes,
changes at the base's own near ties or by the perturbation's size alone.
docs/architecture/drift.md ("The noise margin") reads the results: the
floor, and that an F32 copy of the model has none.

Each row also gives the base's margin (log p1 - log p2, its top two tokens) at
every position a null adapter flipped (`flip_margins`), and `noise_margin`, the
largest of them over the sigma-1e-4 draws: the widest near tie a perturbation
that learned nothing crossed. `--model` measures another GGUF (an F32 copy of
the default model: does the floor come from its quantized arithmetic?).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_drift import GRID, answer_logprobs, changed_where_sure, changed_within, run_setting
from drift_facts import EVAL_FACTS, UNSEEN_PROMPTS, chat_examples
from drift_steps import run_steps  # tests/drift_steps.py: bench_drift puts tests/ on sys.path

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.measure import DriftProbe, lora_b_mask
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.walk.trainer import native_trainer

SIGMAS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
SEEDS = (0, 1, 2)
NOISE_SIGMA = 1e-4      # the null adapters whose choices make an anchor position's "noise set"


def argmax_rows(rm, probe, handle) -> list[np.ndarray]:
    """Per anchor, the argmax at each position of the base's answer with `handle` on."""
    return [lq.argmax(axis=1) for lq in answer_logprobs(rm, probe, handle)]


def changed_beyond_noise(probe, noise: list[list[np.ndarray]], trained: list[np.ndarray]) -> list[int | None]:
    """Per anchor, the first position of the base's answer where the trained
    adapter's choice is neither the base's token nor any null adapter's choice
    there (None: no such position)."""
    out = []
    for i, b in enumerate(probe.bases):
        allowed = [{int(b.answer[j])} | {int(n[i][j]) for n in noise} for j in range(len(b.answer))]
        beyond = [j for j in range(len(b.answer)) if int(trained[i][j]) not in allowed[j]]
        out.append(beyond[0] if beyond else None)
    return out


def base_margins(probe) -> list[np.ndarray]:
    """Per anchor, at each position of the base's answer: log p1 - log p2 of the base's top two tokens."""
    out = []
    for b in probe.bases:
        lp = np.sort(b.top_logp.astype(np.float64), axis=1)
        out.append(lp[:, -1] - lp[:, -2])
    return out


def flip_margins(probe, margins, rows) -> list[float]:
    """The base's margin at every answer position where `rows` (argmax_rows) differs from the base."""
    return [float(margins[i][j]) for i, b in enumerate(probe.bases)
            for j in np.flatnonzero(rows[i] != np.asarray(b.answer))]


def null_adapters(rm, probe, trainer, margins) -> tuple[list[dict], list]:
    """Each null adapter's drift (B drawn at each SIGMA and seed), then the noise set: the
    choices along each base answer of the NOISE_SIGMA draws."""
    rows = []
    base = trainer.lora_parameters()
    is_b = lora_b_mask(trainer)
    for seed in SEEDS:
        draw = np.random.default_rng(seed).standard_normal(int(is_b.sum()))
        for sigma in SIGMAS:
            vec = base.copy()
            vec[is_b] = sigma * draw
            trainer.set_lora_parameters(vec)
            trainer.promote()
            d = run_steps(probe.measure(trainer.served_adapter))
            flips = flip_margins(probe, margins, argmax_rows(rm, probe, trainer.served_adapter))
            row = {"seed": seed, "sigma": sigma, "drift_kl": d.drift_kl, "anchors_changed": d.anchors_changed,
                   "anchors_changed_count": d.changed, "anchors": d.anchors,
                   "changed_within_6": changed_within(d, 6),
                   "changed_where_base_sure": changed_where_sure(d, probe.bases),
                   "first_change": list(d.first_change), "flips": len(flips),
                   "max_flip_margin": max(flips, default=None), "flip_margins": sorted(flips)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("first_change", "flip_margins")}),
                  flush=True)
    noise = []
    for seed in SEEDS:
        vec = base.copy()
        vec[is_b] = NOISE_SIGMA * np.random.default_rng(seed).standard_normal(int(is_b.sum()))
        trainer.set_lora_parameters(vec)
        trainer.promote()
        noise.append(argmax_rows(rm, probe, trainer.served_adapter))
    return rows, noise


def trained_job(rm, probe, margins, noise) -> dict:
    """The default job of bench_drift.py (sampled4-ratio2, seed 3) against the null adapters' noise set."""
    rehearsal = DriftProbe(rm, rehearsal_anchors(), seq_id=0, samples=4)
    run_steps(rehearsal.record())
    unseen = DriftProbe(rm, UNSEEN_PROMPTS, seq_id=0)
    run_steps(unseen.record())
    trained_rows: list = []
    job = run_setting(rm, probe, rehearsal, unseen, "sampled4-ratio2", *GRID["sampled4-ratio2"], seed=3,
                      on_adapter=lambda h: trained_rows.extend(argmax_rows(rm, probe, h)))
    beyond = changed_beyond_noise(probe, noise, trained_rows)
    trained = {k: job[k] for k in ("name", "recall", "drift_kl", "anchors_changed", "anchors_changed_count",
                                   "epochs_run", "train_s")}
    trained.update(changed_beyond_noise=sum(f is not None for f in beyond) / len(beyond),
                   changed_beyond_noise_count=sum(f is not None for f in beyond),
                   first_beyond_noise=beyond, noise_sigma=NOISE_SIGMA, noise_draws=len(SEEDS),
                   first_changes=job["first_changes"])
    print(json.dumps({k: v for k, v in trained.items() if k != "first_changes"}), flush=True)
    trained["flip_margins"] = sorted(flip_margins(probe, margins, trained_rows))
    return trained


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/drift-floor-2026-12-01.json")
    ap.add_argument("--model", default=None, help="a GGUF to measure instead of the default model")
    ap.add_argument("--no-trained-job", action="store_true", help="the null adapters only")
    args = ap.parse_args()
    load_start = os.getloadavg()
    rm = ResidentModel(ResidentConfig(model_path=args.model, n_ctx=512, n_seq=1, n_threads=1))
    probe = DriftProbe(rm, load_anchors(), seq_id=0)
    t = time.perf_counter()
    run_steps(probe.record())
    record_s = time.perf_counter() - t
    margins = base_margins(probe)
    spec = parse_train_request({"examples": chat_examples(EVAL_FACTS)}).to_job_spec()   # the defaults
    trainer = native_trainer(rm, spec, spec.chunk)
    try:
        rows, noise = null_adapters(rm, probe, trainer, margins)
    finally:
        trainer.close()
    null_flips = [m for r in rows if r["sigma"] == NOISE_SIGMA for m in r["flip_margins"]]
    every = np.concatenate(margins)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
           "model": rm.model_path.name, "threads": 1, "rank": spec.rank, "targets": spec.targets,
           "anchors": len(probe.bases), "record_s": record_s, "load_avg_start": load_start, "sure_p": 0.5,
           "log10_sigmas": [math.log10(s) for s in SIGMAS], "noise_sigma": NOISE_SIGMA,
           "noise_margin": max(null_flips, default=None),
           "answer_positions": int(every.size),
           "base_margin_quantiles": {str(q): float(np.quantile(every, q)) for q in (0.05, 0.1, 0.25, 0.5)},
           "base_margins": [m.tolist() for m in margins]}
    trained = None if args.no_trained_job else trained_job(rm, probe, margins, noise)
    out.update(load_avg_end=os.getloadavg(), results=rows)
    if trained is not None:
        out["trained_job"] = trained
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    rm.close()


if __name__ == "__main__":
    main()
