"""The resident model: one llama_model and one llama_context, loaded once.

Every llama call on these handles must come from one thread (the engine
thread, once serving runs). The class owns the native handles and frees them.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamstage import environment, native
from dreamstage.default_model import check_model_file, default_model
from dreamstage.native import ggml_registry
from dreamstage.owner import NativeOwner
from dreamstage.serving import rpc
from dreamstage.serving.rpc import DEAD_AFTER_S

# Serving K/V cache types accepted by --kv-type, mapped to ggml_type ids.
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
# Bytes per element of each K/V type (block size over elements per block).
KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
            "q4_1": 20 / 32, "q4_0": 18 / 32}
# An automatic per-slot context is a multiple of this (llama.cpp pads K/V streams to 256 cells).
AUTO_CTX_STEP = 256

_log_lock = threading.Lock()
# Made once and never freed: a native thread may be calling the installed
# callback (a model or adapter loading elsewhere) while another switches it, so
# a callback that is replaced must stay callable.
_drop_log_cb = None


def quiet_native_logs(enabled: bool = True) -> None:
    """Route llama.cpp/ggml logs to nowhere (default) or back to stderr.

    DREAMSTAGE_NATIVE_LOG=1 keeps them on stderr for debugging.
    """
    global _drop_log_cb
    lc = native.llama_cpp()
    with _log_lock:
        if enabled and not environment.flag("DREAMSTAGE_NATIVE_LOG"):
            if _drop_log_cb is None:
                @lc.llama_log_callback
                def _drop(level, text, user_data):
                    return None
                _drop_log_cb = _drop
            lc.llama_log_set(_drop_log_cb, ctypes.c_void_p())
        else:
            # a NULL callback: llama.cpp logs to stderr again
            lc.llama_log_set(lc.llama_log_callback(), ctypes.c_void_p())


@dataclass(frozen=True)
class ResidentConfig:
    model_path: str | None = None     # None: the embedded default model
    n_ctx: int = 4096                  # total serving context, shared by the slots; 0: automatic (plan_context)
    # With n_ctx 0: the largest share of the K/V device's free memory the serving K/V may take.
    auto_ctx_memory_share: float = 0.25
    n_seq: int = 4                     # parallel sequences (slots)
    n_batch: int = 512
    n_threads: int = 0                 # 0: all cores
    kv_type: str = "f16"               # serving K/V cache type
    flash_attn: str = "auto"           # "auto" | "on" | "off", passed to llama.cpp
    # True: the slots share one cache of n_ctx cells. False: each sequence gets
    # its own stream of n_ctx / n_seq cells, so a sequence's cell layout (and
    # with it the attention's summation order) does not depend on its
    # neighbours: greedy output is then the same batched or alone. `serve`
    # uses False unless --kv-unified (docs/architecture/serving.md).
    kv_unified: bool = True
    seed: int = 0
    # Extra buffer types (CPU_REPACK) repack quantized weights into a layout the
    # training backward (OUT_PROD) does not read; the dream stage refuses to
    # train on them, so they are off unless serving-only speed is wanted.
    use_extra_bufts: bool = False
    # Layers stored on a GPU when the build has a GPU backend, llama-server's
    # -ngl: negative means every layer, 0 keeps the model on the CPU. Ignored
    # by CPU-only builds.
    n_gpu_layers: int = -1
    # RPC workers ("HOST:PORT", dreamstage.serving.rpc) whose devices hold layers,
    # before any local GPU; tensor_split: each device's share of the offloaded
    # layers (llama.cpp's --tensor-split; empty: by free memory); split_mode as llama.cpp's.
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    split_mode: str = "layer"
    rpc_dead_after_s: float = DEAD_AFTER_S         # a worker host silent this long fails (rpc.keep_alive)

    def validate(self) -> None:
        for name in ("n_ctx", "n_seq", "n_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "n_ctx" else 1):
                raise ValueError(f"{name} must be a positive integer{' or 0' if name == 'n_ctx' else ''}, got {v!r}")
        if not 0.0 < self.auto_ctx_memory_share <= 1.0:
            raise ValueError(f"auto_ctx_memory_share must be in (0, 1], got {self.auto_ctx_memory_share!r}")
        if self.n_threads < 0:
            raise ValueError(f"n_threads must be >= 0, got {self.n_threads!r}")
        if not isinstance(self.n_gpu_layers, int):
            raise ValueError(f"n_gpu_layers must be an integer, got {self.n_gpu_layers!r}")
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type {self.kv_type!r} is not one of {', '.join(KV_TYPES)}")
        if self.flash_attn not in ("auto", "on", "off"):
            raise ValueError(f"flash_attn {self.flash_attn!r} is not one of auto, on, off")
        if self.split_mode not in rpc.SPLIT_MODES:
            raise ValueError(f"split_mode {self.split_mode!r} is not one of {', '.join(rpc.SPLIT_MODES)}")
        if self.rpc:
            rpc.parse_endpoints(",".join(self.rpc))
        low, high = rpc.DEAD_AFTER_RANGE
        if not low <= self.rpc_dead_after_s <= high:
            raise ValueError(f"rpc_dead_after_s must be within {low:g} .. {high:g} seconds, "
                             f"got {self.rpc_dead_after_s!r}")
        if self.tensor_split:
            rpc.parse_tensor_split(",".join(map(str, self.tensor_split)))


def model_meta(lc, model, key: str) -> str | None:
    """A GGUF metadata value as text, or None."""
    buf = ctypes.create_string_buffer(4096)
    n = lc.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


def kv_cell_bytes(lc, model, kv_type: str) -> float:
    """Bytes one context cell (a token's K and V in every layer) takes in `kv_type`."""
    arch = model_meta(lc, model, "general.architecture") or ""
    n_head = max(1, lc.llama_model_n_head(model))
    head = lc.llama_model_n_embd(model) // n_head
    k_len = int(model_meta(lc, model, f"{arch}.attention.key_length") or head)
    v_len = int(model_meta(lc, model, f"{arch}.attention.value_length") or head)
    return lc.llama_model_n_layer(model) * lc.llama_model_n_head_kv(model) * (k_len + v_len) * KV_BYTES[kv_type]


def host_available_bytes() -> int | None:
    """Linux's MemAvailable: what the host can still give without swapping. ggml's CPU
    device reports its total as free (upstream calls host free memory ill-defined)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes(device: dict) -> int:
    """What a device (ggml_registry.devices()) can still give: the host's available memory for the CPU."""
    if device["name"] == "CPU":
        host = host_available_bytes()
        return device["free"] if host is None else min(host, device["free"])
    return device["free"]


@dataclass(frozen=True)
class ContextPlan:
    """The serving context and how it was chosen (`/slots`, `/props`, `dreamstage info`)."""
    slot_ctx: int                # the most one request may use: its slot's stream, or the whole pool (kv_unified)
    n_ctx: int                   # the cells asked of llama.cpp, every slot's together
    kv_unified: bool             # one pool all slots share (True), or one stream per slot
    n_ctx_train: int
    chosen_by: str               # "ctx" (configured), "trained" (the model's), "memory" (cut to fit)
    kv_mib: float                # the K/V of all n_ctx cells
    kv_device: str               # the device that holds it
    available_mib: float         # that device's available memory when planned
    output_reserve_mib: float    # the output buffer's most (n_batch rows), host memory, kept out of the share
    memory_share: float          # of available memory, less the output reserve, the K/V may take (automatic only)

    def as_dict(self) -> dict:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def plan_context(lc, model, cfg: ResidentConfig) -> ContextPlan:
    """The serving context. Configured (cfg.n_ctx): n_ctx cells in all, n_ctx / n_seq a
    slot (or all of them for any request, kv_unified). Automatic: the model's trained
    context for each K/V stream (one per slot, or the one pool), cut (to a multiple of
    AUTO_CTX_STEP) so that all of them take at most `auto_ctx_memory_share` of the K/V
    device's available memory, less (on the host) what llama.cpp's output buffer may
    still grow to."""
    n_train = lc.llama_model_n_ctx_train(model)
    cell = kv_cell_bytes(lc, model, cfg.kv_type)
    devices = ggml_registry.devices(tuple(str(e) for e in rpc.parse_endpoints(",".join(cfg.rpc)))) if cfg.rpc \
        else ggml_registry.devices()
    gpus = [d for d in devices if d["name"] != "CPU"]
    holder = gpus if gpus and cfg.n_gpu_layers != 0 else [d for d in devices if d["name"] == "CPU"]
    free = min((available_bytes(d) for d in holder), default=0)
    on_host = not (gpus and cfg.n_gpu_layers != 0)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    reserve = cfg.n_batch * (n_vocab + lc.llama_model_n_embd(model)) * 4
    mib = float(1 << 20)
    streams = 1 if cfg.kv_unified else cfg.n_seq
    if cfg.n_ctx:
        slot, total, chosen = cfg.n_ctx // streams, cfg.n_ctx, "ctx"
    else:
        fits = int(max(0, free - (reserve if on_host else 0)) * cfg.auto_ctx_memory_share / (streams * cell))
        slot = max(AUTO_CTX_STEP, min(n_train, fits) // AUTO_CTX_STEP * AUTO_CTX_STEP)
        total, chosen = slot * streams, "trained" if slot == n_train else "memory"
    return ContextPlan(slot_ctx=slot, n_ctx=total, kv_unified=cfg.kv_unified, n_ctx_train=n_train,
                       chosen_by=chosen, kv_mib=total * cell / mib,
                       kv_device=",".join(d["name"] for d in holder) or "CPU", available_mib=free / mib,
                       output_reserve_mib=reserve / mib, memory_share=cfg.auto_ctx_memory_share)


def _placement(mparams, cfg: ResidentConfig) -> tuple:
    """Set the model's devices, split mode and tensor split: cfg's RPC workers (connected
    now), then the local GPUs. Returns the ctypes arrays mparams points at."""
    workers = rpc.connect(rpc.parse_endpoints(",".join(cfg.rpc)), cfg.rpc_dead_after_s) if cfg.rpc else []
    devices = rpc.model_devices(workers)
    if devices is not None:
        mparams.devices = ctypes.cast(devices, ctypes.c_void_p)
    mparams.split_mode = rpc.SPLIT_MODES[cfg.split_mode]
    split = None
    if cfg.tensor_split:
        n = native.llama_cpp().llama_max_devices()
        if len(cfg.tensor_split) > n:
            raise ValueError(f"tensor_split has {len(cfg.tensor_split)} entries; this build takes at most {n}")
        split = (ctypes.c_float * n)(*cfg.tensor_split)
        mparams.tensor_split = split
    return devices, split


class ResidentModel(NativeOwner):
    """Owns the llama_model and the llama_context; tokenizer helpers included."""

    def __init__(self, config: ResidentConfig | None = None):
        cfg = config or ResidentConfig()
        cfg.validate()
        self.config = cfg
        self.lc = lc = native.llama_cpp()
        native.lib()
        quiet_native_logs()
        lc.llama_backend_init()
        path = check_model_file(cfg.model_path) if cfg.model_path else default_model()
        self.model_path = Path(path)
        self.dependents: weakref.WeakSet[Any] = weakref.WeakSet()  # closed before the context is freed
        self.loads = 0          # how many times the model was loaded (reload adds one)
        # held by reload and by every use of the vocab from any thread: a request's tokenizer
        # call never meets a model being freed (it waits, or gets WorkerFailed when none is loaded)
        self._vocab_lock = threading.RLock()
        self._load()

    def _load(self) -> None:
        lc, cfg, path = self.lc, self.config, self.model_path
        mparams = lc.llama_model_default_params()
        # Repacked CPU weights (CPU_REPACK) change the layout OUT_PROD reads;
        # training needs the plain layout, so the resident model loads without
        # extra buffer types. See docs/architecture/dream-stage.md.
        mparams.use_extra_bufts = cfg.use_extra_bufts
        mparams.n_gpu_layers = cfg.n_gpu_layers
        placement = _placement(mparams, cfg)     # kept alive until the model is loaded
        with native.LOAD_LOCK:
            self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        del placement
        self._refuse_failed_worker()
        if not self.model:
            raise ValueError(f"model file {str(path)!r} could not be loaded by llama.cpp (corrupt or unsupported)")
        if cfg.rpc:
            rpc.watch(cfg.rpc, cfg.rpc_dead_after_s)   # its connections to the workers: a worker's end, a host's
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_ctx_train = lc.llama_model_n_ctx_train(self.model)
        self.context_plan = plan_context(lc, self.model, cfg)
        n_ctx = self.context_plan.n_ctx
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cfg.n_batch
        cparams.n_ubatch = min(cfg.n_batch, 512)
        cparams.n_seq_max = cfg.n_seq
        cparams.kv_unified = cfg.kv_unified
        threads = cfg.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.type_k = KV_TYPES[cfg.kv_type]
        cparams.type_v = KV_TYPES[cfg.kv_type]
        cparams.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[cfg.flash_attn]
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self._refuse_failed_worker()
        if not self.ctx:
            lc.llama_model_free(self.model)
            self.model = None
            raise ValueError(f"could not create a context (n_ctx={n_ctx}, kv_type={cfg.kv_type!r})")
        self.memory = lc.llama_get_memory(self.ctx)
        self.loads += 1
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_embd = lc.llama_model_n_embd(self.model)
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self.n_batch = lc.llama_n_batch(self.ctx)   # llama.cpp clamps n_batch to n_ctx: the largest decode it takes

    def _refuse_failed_worker(self) -> None:
        """ValueError naming an RPC worker that failed while this model loaded (its commands
        were dropped, so what loaded is not whole); the model and context are freed."""
        cfg = self.config
        worker = rpc.failed_worker(cfg.rpc) if cfg.rpc else None
        if worker is None:
            return
        self.close()
        raise ValueError(f"the RPC worker at {worker} failed while the model loaded: it closed the connection or was "
                         f"silent for {cfg.rpc_dead_after_s:g} s (--rpc-dead-after)")

    def kv_cell_bytes(self) -> float:
        """Bytes one context cell (a token's K and V in every layer) takes in the serving K/V type."""
        return kv_cell_bytes(self.lc, self.model, self.config.kv_type)

    def output_rows_bytes(self, rows: int) -> int:
        """Host bytes llama.cpp's output buffer takes to hold `rows` outputs (logits and embeddings)."""
        return rows * (self.n_vocab + self.n_embd) * 4

    def reserve_outputs(self) -> int:
        """Grow llama.cpp's output buffer now to n_batch rows, the most a decode asks for
        (an embeddings request, a scored prompt), rather than at the first such request:
        its memory is then taken before serving starts and before any job measures what
        is free. Returns the buffer's bytes. Before the engine thread starts only: it
        clears the sequences it fills.

        llama_decode sizes the buffer before it computes; an abort callback that stops
        the graph at its first node leaves the buffer grown and the batch's cells
        removed again (a backend without abort support computes the batch: the same)."""
        lc = self.lc
        per_seq = max(1, lc.llama_n_ctx_seq(self.ctx))     # n_batch <= n_ctx: the sequences together hold it
        rows = [(max(self.bos, 0), i % per_seq, i // per_seq, True) for i in range(self.n_batch)]
        seqs = range(rows[-1][2] + 1)
        for seq in seqs:
            lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        stop = lc.ggml_abort_callback(lambda _data: True)
        lc.llama_set_embeddings(self.ctx, True)
        lc.llama_set_abort_callback(self.ctx, stop, None)
        try:
            self.decode_entries(rows, allowed=(0, 2))
        finally:
            lc.llama_set_abort_callback(self.ctx, lc.ggml_abort_callback(), None)
            lc.llama_set_embeddings(self.ctx, False)
            for seq in seqs:
                lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return self.output_rows_bytes(self.n_batch)

    # -- lifetime -------------------------------------------------------------
    def reload(self) -> None:
        """Free the model and its context and load them again from the same config, in
        this object (a failed RPC worker is back: the layers, K/V and adapters it held
        are gone, and ggml's client cannot re-create them under the old handles).
        Dependents are closed first; handles others derived from the old model (adapter
        handles, samplers) must be dropped before. Raises as loading does."""
        with self._vocab_lock:
            self.close()
            self._load()

    def close(self) -> None:
        # objects borrowing the context (a Trainer's dream stage) go first
        for dependent in list(getattr(self, "dependents", ())):
            dependent.close()
        lc = self.lc
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            with self._vocab_lock:
                self.vocab = None
                lc.llama_model_free(self.model)
                self.model = None

    # -- metadata -------------------------------------------------------------
    def _loaded_vocab(self):
        """The vocab handle; call with _vocab_lock held. WorkerFailed while no model is loaded."""
        if not getattr(self, "vocab", None):
            raise rpc.WorkerFailed("the model is not loaded (it loads again once its RPC workers answer)")
        return self.vocab

    def meta(self, key: str) -> str | None:
        with self._vocab_lock:
            self._loaded_vocab()
            return model_meta(self.lc, self.model, key)

    def chat_template(self) -> str | None:
        with self._vocab_lock:
            self._loaded_vocab()
            t = self.lc.llama_model_chat_template(self.model, None)
        return t.decode("utf-8") if t else None

    def token_text(self, token: int) -> str:
        return self.detokenize([token], special=True)

    @property
    def bos(self) -> int:
        with self._vocab_lock:
            return self.lc.llama_vocab_bos(self._loaded_vocab())

    @property
    def eos(self) -> int:
        with self._vocab_lock:
            return self.lc.llama_vocab_eos(self._loaded_vocab())

    def is_eog(self, token: int) -> bool:
        with self._vocab_lock:
            return bool(self.lc.llama_vocab_is_eog(self._loaded_vocab(), token))

    @functools.cached_property
    def eog_tokens(self) -> frozenset[int]:
        """Every end-of-generation token of the vocabulary (read once: the model file fixes it)."""
        with self._vocab_lock:
            vocab = self._loaded_vocab()
            return frozenset(t for t in range(self.n_vocab) if self.lc.llama_vocab_is_eog(vocab, t))

    # -- tokenizer ------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self.lc.llama_token * cap)()
        with self._vocab_lock:
            vocab = self._loaded_vocab()
            n = self.lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                cap = -n
                buf = (self.lc.llama_token * cap)()
                n = self.lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return self.detokenize_bytes(tokens, special).decode("utf-8", "replace")

    def detokenize_bytes(self, tokens: list[int], special: bool = False) -> bytes:
        if not tokens:
            return b""
        arr = (self.lc.llama_token * len(tokens))(*tokens)
        cap = 8 * len(tokens) + 32
        buf = ctypes.create_string_buffer(cap)
        with self._vocab_lock:
            vocab = self._loaded_vocab()
            n = self.lc.llama_detokenize(vocab, arr, len(tokens), buf, cap, False, special)
            if n < 0:
                cap = -n
                buf = ctypes.create_string_buffer(cap)
                n = self.lc.llama_detokenize(vocab, arr, len(tokens), buf, cap, False, special)
        return buf.raw[:n]

    def token_piece(self, token: int, special: bool = False) -> bytes:
        """A token's bytes; `special`: control tokens as their text (else empty)."""
        buf = ctypes.create_string_buffer(64)
        with self._vocab_lock:
            vocab = self._loaded_vocab()
            n = self.lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self.lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    # -- a plain single-sequence generation (demo and tests) ---------------------
    def generate_greedy(self, prompt: str, max_tokens: int = 32, seq_id: int = 0) -> str:
        """Greedy decode on one sequence, clearing it first. Not for concurrent serving."""
        lc = self.lc
        lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        toks = self.tokenize(prompt)
        if len(toks) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(toks)} tokens) plus max_tokens ({max_tokens}) exceeds n_ctx {self.n_ctx}")
        batch = lc.llama_batch_init(max(min(len(toks), self.n_batch), 1), 0, 1)
        out: list[int] = []
        try:
            pos = 0
            pending = toks
            for _ in range(max_tokens):
                while len(pending) > self.n_batch:            # a long prompt: n_batch tokens a decode
                    self._decode_into(batch, pending[:self.n_batch], pos, seq_id, want_last=False)
                    pos, pending = pos + self.n_batch, pending[self.n_batch:]
                self._decode_into(batch, pending, pos, seq_id, want_last=True)
                pos += len(pending)
                logits = lc.llama_get_logits_ith(self.ctx, len(pending) - 1)
                best = (max(range(self.n_vocab), key=logits.__getitem__) if self.n_vocab < 1000
                        else _argmax(logits, self.n_vocab))
                if self.is_eog(best):
                    break
                out.append(best)
                pending = [best]
        finally:
            lc.llama_batch_free(batch)
        return self.detokenize(out)

    def _decode_into(self, batch, tokens: list[int], pos: int, seq_id: int, want_last: bool) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = want_last and i == len(tokens) - 1
        rc = self.lc.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc}")


    def decode_entries(self, entries: list[tuple[int, int, int, bool]], allowed: tuple[int, ...] = (0,)) -> None:
        """llama_decode one batch of (token, pos, seq_id, wants_logits) rows, sequences
        mixed as given (tests and benchmarks); logits_ith(i) then reads row i.
        A status outside `allowed` raises."""
        lc = self.lc
        batch = lc.llama_batch_init(max(len(entries), 1), 0, 1)
        try:
            batch.n_tokens = len(entries)
            for i, (t, pos, seq, out) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos, 1, out
                batch.seq_id[i][0] = seq
            rc = lc.llama_decode(self.ctx, batch)
            if rc not in allowed:
                raise RuntimeError(f"llama_decode failed with status {rc}")
        finally:
            lc.llama_batch_free(batch)


def _argmax(logits_ptr, n: int) -> int:
    import numpy as np
    arr = np.ctypeslib.as_array(logits_ptr, shape=(n,))
    return int(arr.argmax())
