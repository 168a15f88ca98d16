"""The dream stage from Python: LoRA micro-steps on the resident context.

    from dreamstage.serving.resident import ResidentModel
    from dreamstage.training.walk.trainer import Trainer, LoraConfig, OptimizerConfig

    rm = ResidentModel()
    tr = Trainer(rm, LoraConfig(rank=8, alpha=16, targets="attn_q,attn_v"),
                 cache_type="q8_0", window=512, chunk=128, budget_mib=2048)
    tr.begin_window(tokens, loss_mask)      # one window (<= window tokens)
    while tr.chunks_left:
        receipt = tr.micro_step()           # ONE chunk: forward + backward; AdamW at the window's end
    receipts = tr.train_window(tokens, loss_mask)   # the same, all chunks
    tr.promote()                            # shadow -> served (between decode batches)
    tr.save("adapter.gguf")                 # standard GGUF LoRA (llama.cpp --lora)

Conventions the gradient oracle (tests/test_oracle.py) relies on:

- Loss mask: ``loss_mask[i]`` truthy trains the prediction OF ``tokens[i]``
  from ``tokens[:i]`` (so ``loss_mask[0]`` is ignored). The window's loss is
  the mean cross-entropy over its loss tokens. A chunk covering inputs
  ``[p, p+n)`` predicts tokens ``p+1 .. p+n`` and contributes
  ``sum of its CE terms / window loss tokens``; its gradient is that share's
  gradient, so the accumulated gradient is the gradient of the window mean.
  ``Receipt.loss`` is the mean CE over the chunk's own loss tokens
  (``Receipt.tokens`` of them); ``Trainer.window_loss(receipts)`` recombines.
- Plain walk: K/V of earlier chunks are read from the training cache as
  constants (no gradient flows into earlier chunks). With one chunk per window
  the gradient is the exact full-window gradient.
- LoRA: for a frozen weight W (n_out x n_in) the layer computes
  ``y = W x + scale * B (A x)`` with ``scale = alpha / rank``; A has shape
  ``(rank, n_in)``, B ``(n_out, rank)``; A ~ U(+-1/sqrt(n_in)) from ``seed``,
  B = 0.
- Flat vectors (``gradients()``, ``lora_parameters()``,
  ``set_lora_parameters()``), float64 on the Python side (float32 natively):
  layers ascending (only the last ``top_layers`` when set), within a layer
  the targets in the order given in ``LoraConfig.targets``, for each A then B,
  each flattened row-major (numpy ``ravel()`` of the shapes above).
  ``parameter_order()`` returns that order as ``[((layer, target), "a"|"b"), ...]``.
- ``gradients()`` is the gradient accumulated over the current window (or
  the last finished one, before clipping); it restarts at zero when a window
  begins after an optimizer update. With ``accumulate_windows = k`` it sums
  k windows and the update uses their mean (sum / k). The AdamW update (decoupled weight decay, bias-corrected moments,
  global-norm clipping at ``grad_clip`` first) happens after the window's
  last chunk, so with ``lr=0`` the parameters do not move.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, replace

import numpy as np

from dreamstage import native
from dreamstage.native import dream_h
from dreamstage.owner import NativeOwner
from dreamstage.serving import rpc
from dreamstage.training.jobs.spec import DEFAULT_CONTEXT_CACHE_TYPE, GATE_SLACK_MIB, JobSpec
from dreamstage.training.walk.groups import bounded_weights
from dreamstage.training.walk.receipts import DreamError, Receipt

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] | str = ("attn_q", "attn_v")
    top_layers: int = 0          # 0: every layer
    seed: int = 0

    def target_list(self) -> tuple[str, ...]:
        t = self.targets.split(",") if isinstance(self.targets, str) else self.targets
        return tuple(x.strip() for x in t)

    def validate(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be positive, got {self.alpha!r}")
        for t in self.target_list():
            if t not in TARGETS:
                raise ValueError(f"LoRA target {t!r} is not one of {', '.join(TARGETS)}")
        if not isinstance(self.top_layers, int) or self.top_layers < 0:
            raise ValueError(f"top_layers must be an integer >= 0, got {self.top_layers!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0       # global L2 norm; <= 0 disables
    accumulate_windows: int = 1  # windows per update; the update uses their mean gradient


@dataclass(frozen=True)
class TrainerCheckpoint:
    """A trainer's state between two windows, on the host (`Trainer.checkpoint`)."""
    parameters: np.ndarray      # the shadow adapter, float32, flat order
    moments: np.ndarray         # AdamW's first then second moments, float32, 2 * n_params
    updates: int                # optimizer updates so far (the bias correction's step)


@dataclass
class _Pair:
    layer: int
    target: str
    n_in: int
    n_out: int


class Trainer(NativeOwner):
    """One training job's dream stage on a ResidentModel's own llama_context.

    Every call must come from the thread that owns the resident context.
    """

    def __init__(self, resident, lora: LoraConfig | None = None, *, cache_type: str = DEFAULT_CONTEXT_CACHE_TYPE,
                 window: int = 512, chunk: int = 128, budget_mib: float = 0.0, slack_mib: float = 64.0,
                 optimizer: OptimizerConfig | None = None, exact: bool = False, recompute: bool = False,
                 horizon: int = -1):
        self.lora = lora = lora or LoraConfig()
        self.optimizer = opt = optimizer or OptimizerConfig()
        lora.validate()
        self.resident = resident
        self.cache_type = cache_type
        self.L = L = native.lib()
        p = L.dream_default_params()
        p.rank, p.alpha = lora.rank, float(lora.alpha)
        self._targets = ",".join(lora.target_list()).encode()
        self._cache = cache_type.encode()
        p.targets, p.top_layers, p.seed = self._targets, lora.top_layers, lora.seed
        p.context_cache_type = self._cache
        p.window, p.chunk = int(window), int(chunk)
        p.exact, p.recompute, p.horizon = bool(exact), bool(recompute), int(horizon)
        p.lr, p.beta1, p.beta2, p.eps = opt.lr, opt.beta1, opt.beta2, opt.eps
        p.weight_decay, p.grad_clip = opt.weight_decay, opt.grad_clip
        p.accumulate_windows = int(opt.accumulate_windows)
        p.memory_budget_mib, p.slack_mib = float(budget_mib), float(slack_mib)
        self.window, self.chunk = int(window), int(chunk)
        self.exact = bool(exact)        # the exact walk: the gradient does not depend on the chunk
        self.lr = float(opt.lr)
        self.slack_mib = float(slack_mib)
        self._params = p
        self._open()
        self.n_params = int(L.dream_n_params(self._ds))
        self.pairs = self._read_pairs()
        # per group (its tokens): the reply losses of its first and its last pass, for bounded_weights
        self._group_losses: dict[tuple, tuple[list[float], list[float]]] = {}
        self._group_key: tuple | None = None

    # -- lifetime ---------------------------------------------------------------
    def _open(self) -> None:
        """The native dream stage on the resident's context, through the memory gate."""
        self._check_workers()
        r = dream_h.DreamReceiptC()
        self._ds = self.L.dream_init(self.resident.ctx, self._params, ctypes.byref(r))
        self.init_receipt = Receipt.from_c(r)
        if not self._ds:
            self._check_workers()       # the gate's memory query or an allocation met it first: named, not refused
            if self.init_receipt.status == "refused":
                raise DreamError(self.init_receipt)
            raise ValueError(self.init_receipt.message)
        self.resident.dependents.add(self)

    def _failed_worker(self) -> str | None:
        """The resident's RPC worker that failed (its answers are zeros since), or None."""
        workers = getattr(getattr(self.resident, "config", None), "rpc", ())
        return rpc.failed_worker(workers) if workers else None

    def _check_workers(self) -> None:
        """ValueError naming the resident's RPC worker that failed."""
        if gone := self._failed_worker():
            raise ValueError(f"the RPC worker at {gone} failed: restart it, then load the model again")

    def checkpoint(self) -> TrainerCheckpoint:
        """The shadow adapter and the optimizer state, copied to the host. Between windows
        only (no gradient awaiting an update): what `reopen` restores."""
        moments = np.zeros(2 * self.n_params, dtype=np.float32)
        updates = self.L.dream_optimizer_state(self._handle(), moments.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                               moments.size)
        params = self._vec(self.L.dream_get_parameters, self.n_params)
        return TrainerCheckpoint(params, moments, int(updates))

    def reopen(self, cp: TrainerCheckpoint) -> None:
        """After the resident model was loaded again (a failed RPC worker is back): a new
        dream stage of the same shape on its new context, from `cp`, with this trainer's
        chunk and learning rate. The old one must be closed (the resident's reload did)."""
        if self._ds:
            raise RuntimeError("reopen needs the trainer closed first")
        self._open()
        chunk, self.chunk = self.chunk, int(self._params.chunk)
        if chunk != self.chunk:
            self.set_chunk(chunk)
        self.set_lr(self.lr)
        self.set_lora_parameters(cp.parameters)
        data = cp.moments.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if not self.L.dream_set_optimizer_state(self._handle(), data, cp.moments.size, cp.updates):
            raise RuntimeError("dream_set_optimizer_state refused the checkpoint's optimizer state")

    def close(self) -> None:
        if getattr(self, "_ds", None):
            self.L.dream_free(self._ds)
            self._ds = None

    def _handle(self):
        if not self._ds:
            raise RuntimeError("this Trainer is closed")
        return self._ds

    # -- layout -----------------------------------------------------------------
    def _read_pairs(self) -> list[_Pair]:
        out = []
        layer, tgt = ctypes.c_int32(), ctypes.c_char_p()
        n_in, n_out = ctypes.c_int64(), ctypes.c_int64()
        for i in range(self.L.dream_n_pairs(self._ds)):
            self.L.dream_pair_info(self._ds, i, ctypes.byref(layer), ctypes.byref(tgt),
                                   ctypes.byref(n_in), ctypes.byref(n_out))
            out.append(_Pair(layer.value, (tgt.value or b"").decode(), n_in.value, n_out.value))
        return out

    def parameter_order(self) -> list[tuple[tuple[int, str], str]]:
        """[((layer, target), "a" | "b"), ...] in flat-vector order."""
        return [((p.layer, p.target), ab) for p in self.pairs for ab in ("a", "b")]

    def parameter_shapes(self) -> list[tuple[int, int]]:
        """numpy shapes in flat-vector order: A (rank, n_in), B (n_out, rank)."""
        r = self.lora.rank
        return [s for p in self.pairs for s in ((r, p.n_in), (p.n_out, r))]

    def unflatten(self, vec: np.ndarray) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
        """Split a flat vector into {(layer, target): (A, B)}."""
        out, i = {}, 0
        for p in self.pairs:
            a_n, b_n = self.lora.rank * p.n_in, p.n_out * self.lora.rank
            a = vec[i:i + a_n].reshape(self.lora.rank, p.n_in)
            b = vec[i + a_n:i + a_n + b_n].reshape(p.n_out, self.lora.rank)
            out[(p.layer, p.target)] = (a, b)
            i += a_n + b_n
        return out

    # -- the walk ---------------------------------------------------------------
    def begin_window(self, tokens, loss_mask, soft=None) -> None:
        """Start a window: tokens (<= window) and a per-token loss mask of the same length.

        ``soft``: ``(ids, probs)``, two (loss tokens, k) arrays: the prediction of
        the window's r-th loss token is trained against the distribution of row r
        (``probs[r, i]`` on token ``ids[r, i]``; id -1 pads with probability 0;
        each row sums to at most 1, and what it leaves out is the probability of
        every other token together, trained as one more outcome) instead of the
        token itself (dream_window_soft_targets)."""
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
        if toks.ndim != 1 or mask.shape != toks.shape:
            raise ValueError(f"tokens {toks.shape} and loss_mask {mask.shape} must be 1-D of one length")
        r = dream_h.DreamReceiptC()
        st = self.L.dream_window_begin(self._handle(), toks.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                       mask.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(toks), ctypes.byref(r))
        if st != dream_h.DREAM_STATUS_OK:
            raise ValueError(Receipt.from_c(r).message)
        if soft is not None:
            ids = np.ascontiguousarray(soft[0], dtype=np.int32)
            probs = np.ascontiguousarray(soft[1], dtype=np.float32)
            if ids.ndim != 2 or probs.shape != ids.shape:
                raise ValueError(f"soft target ids {ids.shape} and probs {probs.shape} must be 2-D of one shape "
                                 "(loss tokens, k)")
            st = self.L.dream_window_soft_targets(self._handle(), ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                                  probs.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                  ids.shape[1], ids.shape[0], ctypes.byref(r))
            if st != dream_h.DREAM_STATUS_OK:
                raise ValueError(Receipt.from_c(r).message)

    def micro_step(self) -> Receipt:
        """One chunk of the current window; the receipt says what happened (never raises on refusal)."""
        r = dream_h.DreamReceiptC()
        self.L.dream_micro_step(self._handle(), ctypes.byref(r))
        receipt = Receipt.from_c(r)
        if receipt.status == "error" and (gone := self._failed_worker()) and gone not in receipt.message:
            # the worker failed before the step (met by other work first): its graph failed at once
            receipt = replace(receipt, message=f"the RPC worker at {gone} failed: {receipt.message}")
        return receipt

    def gate_devices(self) -> list[dict[str, float | str]]:
        """The last gate check's figures per device (ggml's device order): what the step (or the
        job's start) would have added there and that device's allowance, MiB."""
        n = int(self.L.dream_gate_devices(self._handle(), None, 0))
        rows = (dream_h.DreamGateDeviceC * max(n, 1))()
        n = min(n, int(self.L.dream_gate_devices(self._handle(), rows, n)))
        return [{"device": r.device.decode("utf-8", "replace"), "need_mib": r.need_mib,
                 "allowance_mib": r.allowance_mib} for r in rows[:n]]

    @property
    def chunks_left(self) -> int:
        return int(self.L.dream_chunks_left(self._handle()))

    def train_window(self, tokens, loss_mask, soft=None) -> list[Receipt]:
        """begin_window, then micro-steps until the window ends or a step is not ok."""
        self.begin_window(tokens, loss_mask, soft)
        return self._steps_to_end()

    def _steps_to_end(self) -> list[Receipt]:
        out = []
        while self.chunks_left:
            rec = self.micro_step()
            out.append(rec)
            if not rec.ok:
                break
        return out

    def begin_group(self, prefix, replies, share_prefix: bool = True) -> None:
        """Start a shared-prefix group instead of a window (dream_group_begin).

        ``prefix``: the prompt's tokens; ``replies``: ``[(tokens, loss_mask, weight), ...]``,
        ``loss_mask[i]`` truthy trains the prediction of the reply's token i (its first
        token is predicted from the prompt's last). The group's loss is
        ``sum_g weight_g * mean CE(reply g) / G``: the mean of G separate windows
        (prompt + reply g), each window's loss times its weight, in one update.

        ``share_prefix=False`` computes the same loss as G separate exact windows: the
        native group then shares only the prompt's first token (its cells never
        need a second pass), and each reply re-runs the rest of the prompt
        (faster for one reply or a short prompt: dreamstage.training.walk.groups.prefer_group)."""
        pre = np.ascontiguousarray(prefix, dtype=np.int32)
        if pre.ndim != 1 or len(pre) < 1:
            raise ValueError(f"prefix must be 1-D with at least one token, got shape {pre.shape}")
        toks, masks, lens, weights = [], [], [], []
        self._group_key = (tuple(int(x) for x in pre), tuple(tuple(int(x) for x in t) for t, _, _ in replies))
        first, last = self._group_losses.get(self._group_key, (None, None))
        bounded = bounded_weights([w for _, _, w in replies], last, first)
        for i, ((t, m, _), w) in enumerate(zip(replies, bounded, strict=True)):
            t, m = np.asarray(t, dtype=np.int32), np.asarray(m, dtype=np.uint8)
            if t.ndim != 1 or m.shape != t.shape:
                raise ValueError(f"reply {i}: tokens {t.shape} and loss_mask {m.shape} must be 1-D of one length")
            if not share_prefix:
                t = np.concatenate([pre[1:], t]).astype(np.int32)
                m = np.concatenate([np.zeros(len(pre) - 1, np.uint8), m])
            toks.append(t)
            masks.append(m)
            lens.append(len(t))
            weights.append(float(w))
        if not toks:
            raise ValueError("a group needs at least one reply")
        if not share_prefix:
            pre = np.ascontiguousarray(pre[:1])
        tok = np.ascontiguousarray(np.concatenate(toks), dtype=np.int32)
        msk = np.ascontiguousarray(np.concatenate(masks), dtype=np.uint8)
        ln = np.ascontiguousarray(lens, dtype=np.int32)
        wt = np.ascontiguousarray(weights, dtype=np.float32)
        i32 = ctypes.POINTER(ctypes.c_int32)
        r = dream_h.DreamReceiptC()
        st = self.L.dream_group_begin(self._handle(), pre.ctypes.data_as(i32), len(pre), tok.ctypes.data_as(i32),
                                      msk.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), ln.ctypes.data_as(i32),
                                      wt.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(lens), ctypes.byref(r))
        if st != dream_h.DREAM_STATUS_OK:
            raise ValueError(Receipt.from_c(r).message)

    def train_group(self, prefix, replies, share_prefix: bool = True) -> list[Receipt]:
        """begin_group, then micro-steps until the group ends or a step is not ok."""
        self.begin_group(prefix, replies, share_prefix)
        return self._steps_to_end()

    def group_reply_losses(self) -> list[float]:
        """Mean CE over each reply's loss tokens of the current or last group (unweighted; NaN
        for a reply not walked yet); [] when no group began since the last window."""
        n = int(self.L.dream_group_reply_losses(self._handle(), None, 0))
        buf = (ctypes.c_double * max(n, 1))()
        self.L.dream_group_reply_losses(self._handle(), buf, n)
        losses = [float(buf[i]) for i in range(n)]
        if self._group_key is not None and n == len(self._group_key[1]):
            first = self._group_losses.get(self._group_key, (losses, losses))[0]
            self._group_losses[self._group_key] = (first, losses)   # the next pass bounds its weights by them
        return losses

    @staticmethod
    def window_loss(receipts: list[Receipt]) -> float:
        """Mean CE over the window's loss tokens from its chunks' receipts."""
        n = sum(r.tokens for r in receipts)
        return sum(r.loss * r.tokens for r in receipts) / n if n else float("nan")

    # -- vectors ----------------------------------------------------------------
    def _vec(self, fn, n: int) -> np.ndarray:
        buf = np.zeros(n, dtype=np.float32)
        ok = fn(self._handle(), buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        if ok is False or (not isinstance(ok, bool) and ok < 0):
            raise RuntimeError(f"{fn.__name__} refused a buffer of {n} floats")
        return buf

    def gradients(self) -> np.ndarray:
        """The accumulated LoRA gradient of the current/last window (float64, flat order)."""
        return self._vec(self.L.dream_gradients, self.n_params).astype(np.float64)

    def lora_parameters(self) -> np.ndarray:
        """The shadow adapter's parameters (float64, flat order)."""
        return self._vec(self.L.dream_get_parameters, self.n_params).astype(np.float64)

    def set_lora_parameters(self, vec) -> None:
        """Overwrite the shadow adapter (flat order; rounded to float32)."""
        v = np.ascontiguousarray(vec, dtype=np.float32)
        if v.shape != (self.n_params,):
            raise ValueError(f"parameter vector has shape {v.shape}, the adapter takes ({self.n_params},)")
        data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if not self.L.dream_set_parameters(self._handle(), data, self.n_params):
            raise RuntimeError("dream_set_parameters refused the vector")

    # -- serving ------------------------------------------------------------------
    def promote(self) -> int:
        """Copy shadow -> served; returns the served version. Call between decode batches."""
        return int(self.L.dream_promote(self._handle()))

    @property
    def served_adapter(self) -> int:
        """Address of the served llama_adapter_lora (for llama_set_adapters_lora)."""
        return int(self.L.dream_served_adapter(self._handle()))

    def set_chunk(self, chunk: int) -> None:
        """Tokens per micro-step from the next one on (the chunk ladder after a refusal).

        The window's position, its accumulated gradient and the optimizer state stay."""
        if not isinstance(chunk, int) or not self.L.dream_set_chunk(self._handle(), chunk):
            raise ValueError(f"chunk must be an integer in 1..{self.window}, got {chunk!r}")
        self.chunk = chunk

    def set_lr(self, lr: float) -> None:
        """AdamW's learning rate from the next optimizer update on (the moments
        do not depend on it, so a schedule is this call between windows)."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not self.L.dream_set_lr(self._handle(),
                                                                                             float(lr)):
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        self.lr = float(lr)

    def set_step_deadline(self, ms: float | None) -> None:
        """Stop a micro-step whose graph is still computing `ms` after it began
        (status "stopped"; the next micro_step goes on with it, keeping what it
        computed). None or <= 0: no deadline. Only graphs wholly on the CPU stop;
        reverse-pass and group chunks always finish (dream_set_step_deadline)."""
        if ms is not None and not (isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms)):
            raise ValueError(f"step deadline must be a finite number of ms or None, got {ms!r}")
        self.L.dream_set_step_deadline(self._handle(), float(ms) if ms is not None and ms > 0 else 0.0)

    def set_step_abort(self, ms: float | None) -> None:
        """Abort a micro-step that could stop at a deadline but is still
        computing `ms` after it began, between two graph nodes, and undo it
        (status "aborted"; the next micro_step starts the chunk again). None or
        <= 0: no limit. CPU graphs only, as the deadline (dream_set_step_abort)."""
        if ms is not None and not (isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms)):
            raise ValueError(f"step time limit must be a finite number of ms or None, got {ms!r}")
        self.L.dream_set_step_abort(self._handle(), float(ms) if ms is not None and ms > 0 else 0.0)

    @property
    def last_step_stoppable(self) -> bool:
        """Whether the last micro-step could have stopped at a step deadline: a
        plain-walk chunk whose graph ran wholly on the CPU (False before the
        first step). Where it is False, a deadline does not bound the pause."""
        return bool(self.L.dream_last_step_stoppable(self._handle()))

    # -- files ----------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the shadow adapter as a standard GGUF LoRA (atomically)."""
        from dreamstage.adapters.files import save_lora
        save_lora(path, self.unflatten(self.lora_parameters()), alpha=self.lora.alpha,
                  model_arch=self.resident.meta("general.architecture") or "llama")

    def load(self, path) -> None:
        """Replace the shadow adapter's parameters by a GGUF LoRA file of the same layout."""
        from dreamstage.adapters.files import load_lora
        factors, alpha = load_lora(path)
        if abs(alpha - self.lora.alpha) > 1e-6:
            raise ValueError(f"{path}: alpha {alpha} differs from this trainer's {self.lora.alpha}")
        vec = []
        for p in self.pairs:
            key = (p.layer, p.target)
            if key not in factors:
                raise ValueError(f"{path}: no tensors for blk.{p.layer}.{p.target}")
            a, b = factors[key]
            if a.shape != (self.lora.rank, p.n_in) or b.shape != (p.n_out, self.lora.rank):
                raise ValueError(f"{path}: blk.{p.layer}.{p.target} has shapes {a.shape}/{b.shape}")
            vec += [a.ravel(), b.ravel()]
        extra = set(factors) - {(p.layer, p.target) for p in self.pairs}
        if extra:
            raise ValueError(f"{path}: tensors for weights this trainer does not adapt: {sorted(extra)[:4]}")
        self.set_lora_parameters(np.concatenate(vec))


def native_trainer(resident, spec: JobSpec, chunk: int, lr: float | None = None) -> Trainer:
    """The native Trainer for a job (lr=0 makes an evaluator that never moves).

    An evaluator (lr given) runs the plain walk: it needs only the forward
    loss, which both walks compute alike, and the exact walk would add a
    reverse pass and adjoint buffers for nothing."""
    exact = spec.exact and lr is None
    return Trainer(resident, LoraConfig(**spec.lora_fields()), cache_type=spec.context_cache_type,
                   window=spec.window, chunk=chunk, budget_mib=spec.memory_budget_mib or 0.0,
                   slack_mib=GATE_SLACK_MIB, optimizer=OptimizerConfig(lr=spec.lr if lr is None else lr), exact=exact,
                   horizon=(spec.horizon or 0) if exact else -1, recompute=spec.recompute)
