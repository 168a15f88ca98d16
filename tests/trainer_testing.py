"""The native Trainer with the probes only tests read: optimizer state, memory holdings,
graph facts, and setters of what a job fixes at start (budget, horizon, graph reuse)."""
from __future__ import annotations

import ctypes

import numpy as np

from dreamstage.training.walk.trainer import Trainer


class ProbedTrainer(Trainer):
    """`Trainer` plus test-only reads and setters over the same native handle."""

    def optimizer_state(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(first moments, second moments, update count); zeros before the first update."""
        buf = np.zeros(2 * self.n_params, dtype=np.float32)
        t = self.L.dream_optimizer_state(self._handle(), buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), buf.size)
        return buf[:self.n_params].astype(np.float64), buf[self.n_params:].astype(np.float64), int(t)

    def apply_served(self, scale: float = 1.0) -> None:
        """Make serving on the resident context use the served adapter (scale 1.0 = alpha/rank)."""
        lc = self.resident.lc
        arr = (ctypes.c_void_p * 1)(self.served_adapter)
        scales = (ctypes.c_float * 1)(scale)
        adapters = ctypes.cast(arr, ctypes.POINTER(lc.llama_adapter_lora_p_ctypes))
        rc = lc.llama_set_adapters_lora(self.resident.ctx, adapters, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed with {rc}")

    def set_graph_reuse(self, on: bool) -> None:
        """Reuse the last micro-step's allocated graph for a chunk of the same shape
        (on by default; off: every step builds, plans and allocates its own)."""
        self.L.dream_set_graph_reuse(self._handle(), bool(on))

    @property
    def fused_attention(self) -> bool:
        """Whether training graphs run attention fused (FLASH_ATTN_EXT and the dream
        stage's backward; every layer's attention on CUDA) or as explicit products."""
        return bool(self.L.dream_fused_attention(self._handle()))

    @property
    def optimizer_on_device(self) -> bool:
        """Whether the gradient accumulator and AdamW's moments live on the adapter's
        GPU (every A and B on one GPU) or on the host."""
        return bool(self.L.dream_optimizer_on_device(self._handle()))

    @property
    def graph_reuses(self) -> int:
        """Micro-steps so far that computed the previous step's graph again."""
        return int(self.L.dream_graph_reuses(self._handle()))

    def set_horizon(self, horizon: int) -> int:
        """Exact walk: the positions before a chunk that receive gradient from the next micro-step on
        (<= 0: the whole window). Returns the horizon now in use."""
        if not isinstance(horizon, int):
            raise ValueError(f"horizon must be an integer, got {horizon!r}")
        h = int(self.L.dream_set_horizon(self._handle(), horizon))
        if h < 0:
            raise ValueError("horizon applies to the exact walk only (this Trainer has exact=False)")
        return h

    def set_budget(self, budget_mib: float) -> None:
        """Replace the job's memory budget (MiB; <= 0: device free memory only)."""
        self.L.dream_set_budget(self._handle(), float(budget_mib))

    def held_mib(self) -> float:
        """What the job holds now against its budget (MiB); the gate allows
        budget - held - slack, never less than 0."""
        return float(self.L.dream_held_mib(self._handle()))
