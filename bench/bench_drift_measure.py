"""What one drift measurement costs: the 20 measured anchors teacher-forced with
an adapter on, each anchor decoded whole against the anchors sharing their common
head (DriftProbe(share_head=...)), alternating in one run.

    nice python bench/bench_drift_measure.py --reps 3 --out bench/results/drift-measure.json

One resident default model, one thread, a rank-8 q,v adapter that learned
nothing (B ~ N(0, NULL_SIGMA^2): what each of a job's NULL_DRAWS null draws
measures). Each row: the measurement's wall time, its decodes, and whether its
figures are bit-identical to the whole decode's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from drift_steps import run_steps

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.drift.anchors import load_anchors
from dreamstage.training.drift.decoding import Decoder
from dreamstage.training.drift.measure import NULL_SIGMA, DriftProbe, lora_b_mask
from dreamstage.training.walk.trainer import LoraConfig, Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/drift-measure.json")
    args = ap.parse_args()
    m = ResidentModel(ResidentConfig(n_ctx=2048, n_seq=1, n_threads=1))
    decodes = [0]
    real = Decoder._decode

    def counted(self, *a, **k):
        decodes[0] += 1
        return real(self, *a, **k)
    Decoder._decode = counted                          # type: ignore[method-assign]
    rows = []
    try:
        recorder = DriftProbe(m, load_anchors(), seq_id=0, step_ms=None)
        run_steps(recorder.record())
        tr = Trainer(m, LoraConfig(rank=8, targets="attn_q,attn_v"), window=128, chunk=128)
        try:
            v = tr.lora_parameters()
            is_b = lora_b_mask(tr)
            v[is_b] = NULL_SIGMA * np.random.default_rng(0).standard_normal(int(is_b.sum()))
            tr.set_lora_parameters(v)
            tr.promote()
            ref = None
            for rep in range(args.reps):
                for share in (False, True):
                    probe = DriftProbe(m, recorder.prompts, seq_id=0, step_ms=None, share_head=share)
                    probe.bases = recorder.bases
                    decodes[0] = 0
                    t0 = time.perf_counter()
                    d = run_steps(probe.measure(tr.served_adapter))
                    ms = (time.perf_counter() - t0) * 1000.0
                    ref = d if ref is None else ref
                    rows.append({"rep": rep, "share_head": share, "ms": round(ms, 1), "decodes": decodes[0],
                                 "tokens": d.tokens, "identical": d.drops == ref.drops and d.drift_kl == ref.drift_kl})
                    print(rows[-1], flush=True)
        finally:
            tr.close()
    finally:
        Decoder._decode = real                         # type: ignore[method-assign]
        m.close()
    summary = {}
    for share in (False, True):
        mine = [r for r in rows if r["share_head"] == share]
        summary["shared" if share else "whole"] = {"ms_median": statistics.median(r["ms"] for r in mine),
                                                   "decodes": mine[0]["decodes"],
                                                   "identical": all(r["identical"] for r in mine)}
    summary["speedup"] = round(summary["whole"]["ms_median"] / summary["shared"]["ms_median"], 3)
    out = {"bench": "drift_measure", "anchors": len(load_anchors()), "threads": 1,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average_at_end": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d"), "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
