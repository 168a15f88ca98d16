"""Does the drift measurement read the same logits with an adapter that adds nothing?

On the H200 the drift guard's null adapters (B ~ N(0, NULL_SIGMA^2))
moved the default model's answers at base leads of 0.9 to 3.7 nats, where on
the CPU the same draws stay at 0.4 to 1.1, and trained jobs measured drift_kl
0.034 where the CPU measures 0.013. Either the GPU's arithmetic moves that far,
or the adapter-on decode (LoRA nodes, patch 0104's fusion, the ADD that
patch 0103 lets ggml-cuda fuse into the base product) reads other logits than
the adapter-off decode the base was recorded with. This separates the two:

  1. the adapter off, measured against its own records: must be 0;
  2. an adapter with B = 0 exactly (it adds nothing): 0 when the adapter-on
     graph computes the base product as the adapter-off one does;
  3. a null draw (B ~ N(0, NULL_SIGMA^2)): what the guard's margin reads.

    python3 bench/gpu/drift_zero_check.py MODEL.gguf [--anchors 6] [--rank 16]

Prints one JSON line per case: drift_kl, the widest lead drop, answers changed.
Run it with DREAMSTAGE_LORA_FUSION=0 and/or GGML_CUDA_DISABLE_FUSION=1 to see
which fusion moves case 2. tests/test_drift.py checks case 2 on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from drift_steps import run_steps  # tests/drift_steps.py: PYTHONPATH needs tests/

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.drift.anchors import load_anchors
from dreamstage.training.drift.measure import NULL_SIGMA, DriftProbe, lora_b_mask
from dreamstage.training.walk.trainer import LoraConfig, Trainer


def figures(case: str, d) -> dict:
    return {"case": case, "drift_kl": d.drift_kl, "widest_drop": d.widest_drop, "changed_raw": d.changed_raw,
            "anchors": d.anchors, "tokens": d.tokens,
            "env": {k: os.environ.get(k) for k in ("DREAMSTAGE_LORA_FUSION", "GGML_CUDA_DISABLE_FUSION",
                                                  "NVIDIA_TF32_OVERRIDE")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--anchors", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="attn_q,attn_k,attn_v,attn_output")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    res = ResidentModel(ResidentConfig(model_path=args.model, n_ctx=1024, n_seq=1, n_threads=args.threads))
    try:
        probe = DriftProbe(res, load_anchors()[:args.anchors], seq_id=0)
        run_steps(probe.record())
        print(json.dumps(figures("adapter off", run_steps(probe.measure(None)))), flush=True)
        tr = Trainer(res, LoraConfig(rank=args.rank, targets=args.targets), window=128, chunk=128)
        try:
            tr.promote()                                        # B = 0: adds exactly nothing
            print(json.dumps(figures("B = 0", run_steps(probe.measure(tr.served_adapter)))), flush=True)
            vec = tr.lora_parameters()
            is_b = lora_b_mask(tr)
            vec[is_b] = NULL_SIGMA * np.random.default_rng(0).standard_normal(int(is_b.sum()))
            tr.set_lora_parameters(vec)
            tr.promote()
            print(json.dumps(figures(f"null draw (sigma {NULL_SIGMA})",
                                     run_steps(probe.measure(tr.served_adapter)))), flush=True)
        finally:
            tr.close()
    finally:
        res.close()


if __name__ == "__main__":
    main()
