"""Are the changes a job makes beyond its noise margin its own, or the rounding's?

Reads `bench_drift.py --noise-margin --jitters K` results: the final adapter
measured once as it is and K more times with NULL_SIGMA noise added to every B,
and the job's null draws (the base with the same noise). At each answer
position of each held-out anchor it counts how often the argmax left the base's
token under the adapter's measurements (`adapter`) and under the null draws
(`null`), and the adapter's mean lead drop there. A flip that a rounding
accident made at the adapter's point shows up in few of its measurements; one
the adapter makes itself shows up in most, with a mean drop above the base's
lead.

    python bench/drift_jitter.py bench/results/drift-jitter-seed3-2026-12-03.json ...

Per file: every position beyond the margin that any adapter measurement
flipped, and the anchors counted by each rule:
  once       the adapter as it is flips a position beyond the margin (anchors_changed)
  majority   at least half the adapter's measurements flip one there
  mean       the mean drop there exceeds the base's lead
  all        every measurement flips one there
  near ties  at least half the adapter's measurements flip a position, at any lead,
             that fewer than half the null draws flip
"""

from __future__ import annotations

import json
import sys

import numpy as np


def report(path: str) -> dict[str, int]:
    with open(path) as f:
        res = json.load(f)["results"][0]
    jit, margin = res["jitter"], res["noise_margin"]
    leads = [np.asarray(x) for x in jit["base_leads"]]
    measured = [jit["adapter_drops"], *jit["jitter_drops"]]
    adapter = [[np.asarray(d) for d in m] for m in measured]
    nulls = [[np.asarray(d) for d in m] for m in jit["null_drops"]]
    print(f"{path}: margin {margin:.3f}, {len(adapter)} adapter measurements, {len(nulls)} null draws, "
          f"recall {res['recall']:.2f}, drift_kl {res['drift_kl']:.4f}")
    counts = dict.fromkeys(("once", "majority", "mean", "all", "near ties"), 0)
    for a, lead in enumerate(leads):
        fa = np.mean([m[a] > lead for m in adapter], axis=0)
        f0 = np.mean([m[a] > lead for m in nulls], axis=0)
        mean = np.mean([m[a] for m in adapter], axis=0)
        beyond = lead > margin
        rules = {"once": (adapter[0][a] > lead) & beyond, "majority": (fa >= 0.5) & beyond,
                 "mean": (mean > lead) & beyond, "all": (fa == 1.0) & beyond,
                 "near ties": (fa >= 0.5) & (f0 < 0.5)}
        for k, hit in rules.items():
            counts[k] += int(hit.any())
        for p in np.flatnonzero(beyond & (fa > 0)):
            print(f"  anchor {a:2d} position {p:2d}: base lead {lead[p]:.3f}, flipped by {fa[p]:.0%} of the "
                  f"adapter's measurements and {f0[p]:.0%} of the null draws, mean drop {mean[p]:.3f}")
    print("  anchors counted:", counts)
    return counts


if __name__ == "__main__":
    for p in sys.argv[1:]:
        report(p)
