"""Experiment: keep the LoRA's A out of the subspace general prompts use.

For each layer, the inputs of attn_q / attn_v (the attn_norm output) on the
rehearsal anchors' windows (computed with the float64 NumPy reference of the
tests, tests/numpy_ref.py) give a covariance; A's rows are kept orthogonal to
its top eigenvectors (the fraction `energy` of the trace), so on tokens whose
input lies in that span B A x is (nearly) zero. A projection after every
update (and of the initial A). Tried (bench_drift.py's
`defaults-project*`, docs/benchmarks.md): held-out drift rose, so not used.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def attn_inputs(model_path, sequences) -> list[np.ndarray]:
    from numpy_ref import Forward, LlamaRef
    ref = LlamaRef.from_gguf(model_path)
    per_layer: list[list[np.ndarray]] = [[] for _ in range(ref.n_layer)]
    for toks in sequences:
        f = Forward(ref, list(toks))
        for il, c in enumerate(f.cache):
            per_layer[il].append(c["a"])
    return [np.concatenate(x) for x in per_layer]


def projectors(acts: list[np.ndarray], energy: float) -> tuple[list[np.ndarray], list[int]]:
    out, ks = [], []
    for x in acts:
        c = x.T @ x
        w, v = np.linalg.eigh(c)
        w, v = w[::-1], v[:, ::-1]
        cum = np.cumsum(w) / w.sum()
        k = int(np.searchsorted(cum, energy) + 1)
        u = v[:, :k]
        out.append(np.eye(c.shape[0]) - u @ u.T)
        ks.append(k)
    return out, ks


class Projection:
    def __init__(self, trainer, projs: list[np.ndarray], keep_norm: bool = True):
        self.trainer, self.projs = trainer, projs
        self.spans = []
        i = 0
        for (key, ab), shape in zip(trainer.parameter_order(), trainer.parameter_shapes(), strict=True):
            n = int(np.prod(shape))
            if ab == "a":
                self.spans.append((i, shape, key[0]))
            i += n
        self.apply(keep_norm=keep_norm)

    def apply(self, keep_norm: bool = False) -> None:
        vec = self.trainer.lora_parameters()
        for i, shape, il in self.spans:
            n = int(np.prod(shape))
            a = vec[i:i + n].reshape(shape)
            pa = a @ self.projs[il]
            if keep_norm:
                norm = np.maximum(np.linalg.norm(pa, axis=1, keepdims=True), 1e-30)
                pa *= np.linalg.norm(a, axis=1, keepdims=True) / norm
            vec[i:i + n] = pa.ravel()
        self.trainer.set_lora_parameters(vec)
