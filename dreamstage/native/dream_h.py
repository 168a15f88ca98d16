"""The ctypes mirror of dreamstage/ggml_ext/dream.h: its status codes and structs
field for field, and each function's signature with its C prototype above it
(the test hooks of dream-testing.h in a section of their own).

Declarations only: dreamstage.native loads the library and calls `declare` on it.
"""
from __future__ import annotations

import ctypes

DREAM_STATUS_OK, DREAM_STATUS_REFUSED, DREAM_STATUS_ERROR, DREAM_STATUS_STOPPED, DREAM_STATUS_ABORTED = 0, 1, 2, 3, 4


class DreamReceiptC(ctypes.Structure):
    """struct dream_receipt (dream.h), field for field."""
    _fields_ = [
        ("status", ctypes.c_int32),
        ("step", ctypes.c_int64),
        ("window", ctypes.c_int32),
        ("chunk", ctypes.c_int32),
        ("chunk_pos", ctypes.c_int32),
        ("chunk_tokens", ctypes.c_int32),
        ("context_cache_type", ctypes.c_char * 16),
        ("recompute", ctypes.c_bool),
        ("exact", ctypes.c_bool),
        ("horizon", ctypes.c_int32),
        ("walk_pass", ctypes.c_char * 12),
        ("loss", ctypes.c_double),
        ("tokens", ctypes.c_int32),
        ("ms", ctypes.c_double),
        ("graph_mib", ctypes.c_double),
        ("context_mib", ctypes.c_double),
        ("adapter_mib", ctypes.c_double),
        ("optimizer_mib", ctypes.c_double),
        ("walk_mib", ctypes.c_double),
        ("refused_chunk_pos", ctypes.c_int32),
        ("refused_chunk_tokens", ctypes.c_int32),
        ("refused_need_mib", ctypes.c_double),
        ("refused_allowance_mib", ctypes.c_double),
        ("message", ctypes.c_char * 512),
        ("group_reply", ctypes.c_int32),
        ("aborted_had_ms", ctypes.c_double),
        ("aborted_need_ms", ctypes.c_double),
        ("refused_device", ctypes.c_char * 48),
        ("rpc_bytes", ctypes.c_int64),
    ]


class DreamGateDeviceC(ctypes.Structure):
    """struct dream_gate_device (dream.h): one device's figures in the last gate check."""
    _fields_ = [
        ("device", ctypes.c_char * 48),
        ("need_mib", ctypes.c_double),
        ("allowance_mib", ctypes.c_double),
    ]


class DreamFieldLayoutC(ctypes.Structure):
    """struct dream_field_layout (dream.h): one member of a struct as the library was compiled."""
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("offset", ctypes.c_size_t),
        ("size", ctypes.c_size_t),
    ]


def receipt_layout_mismatches(L: ctypes.CDLL, mirror: type[ctypes.Structure] | None = None) -> list[str]:
    """How `mirror` (DreamReceiptC) differs from struct dream_receipt as `L`
    was compiled (dream_receipt_layout); empty when they agree member for member."""
    mirror = mirror if mirror is not None else DreamReceiptC
    fields = ctypes.POINTER(DreamFieldLayoutC)()
    size = ctypes.c_size_t(0)
    n = L.dream_receipt_layout(ctypes.byref(fields), ctypes.byref(size))
    c_side = [(fields[i].name.decode(), fields[i].offset, fields[i].size) for i in range(n)]
    py_side = [(f[0], getattr(mirror, f[0]).offset, getattr(mirror, f[0]).size) for f in mirror._fields_]
    out = []
    if size.value != ctypes.sizeof(mirror):
        out.append(f"sizeof(struct dream_receipt) is {size.value} in C, {ctypes.sizeof(mirror)} in {mirror.__name__}")
    c_names, py_names = {f[0] for f in c_side}, {f[0] for f in py_side}
    out += [f"{name} is in struct dream_receipt but not in {mirror.__name__}" for name, _, _ in c_side
            if name not in py_names]
    out += [f"{name} is in {mirror.__name__} but not in struct dream_receipt" for name, _, _ in py_side
            if name not in c_names]
    py_at = {name: (off, sz) for name, off, sz in py_side}
    for name, off, sz in c_side:
        if name in py_at and py_at[name] != (off, sz):
            out.append(f"{name}: offset {off}, size {sz} in C; offset {py_at[name][0]}, size {py_at[name][1]} "
                       f"in {mirror.__name__}")
    return out



class DreamParamsC(ctypes.Structure):
    """struct dream_params (dream.h), field for field."""
    _fields_ = [
        ("rank", ctypes.c_int32),
        ("alpha", ctypes.c_float),
        ("targets", ctypes.c_char_p),
        ("top_layers", ctypes.c_int32),
        ("seed", ctypes.c_uint32),
        ("context_cache_type", ctypes.c_char_p),
        ("window", ctypes.c_int32),
        ("chunk", ctypes.c_int32),
        ("exact", ctypes.c_bool),
        ("recompute", ctypes.c_bool),
        ("horizon", ctypes.c_int32),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("grad_clip", ctypes.c_float),
        ("accumulate_windows", ctypes.c_int32),
        ("memory_budget_mib", ctypes.c_double),
        ("slack_mib", ctypes.c_double),
    ]


def declare(L: ctypes.CDLL) -> None:
    """Declare dream.h's functions on `L` (each C prototype above its line), then the rest."""
    p, f32p, R = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(DreamReceiptC)
    # const char * dream_build_info(void);
    L.dream_build_info.argtypes = []
    L.dream_build_info.restype = ctypes.c_char_p
    # int32_t dream_receipt_layout(const struct dream_field_layout ** fields, size_t * struct_size);
    # (declared only when present: native's load check names a library that lacks it)
    if hasattr(L, "dream_receipt_layout"):
        L.dream_receipt_layout.argtypes = [ctypes.POINTER(ctypes.POINTER(DreamFieldLayoutC)),
                                           ctypes.POINTER(ctypes.c_size_t)]
        L.dream_receipt_layout.restype = ctypes.c_int32
    # const char * dream_context_cache_types(void);
    if hasattr(L, "dream_context_cache_types"):
        L.dream_context_cache_types.argtypes = []
        L.dream_context_cache_types.restype = ctypes.c_char_p
    # struct dream_params dream_default_params(void);
    L.dream_default_params.argtypes = []
    L.dream_default_params.restype = DreamParamsC
    # struct dream_stage * dream_init(struct llama_context * ctx, struct dream_params params,
    #                                 struct dream_receipt * receipt);
    L.dream_init.argtypes = [p, DreamParamsC, R]
    L.dream_init.restype = p
    # void dream_free(struct dream_stage * ds);
    L.dream_free.argtypes = [p]
    L.dream_free.restype = None
    # int32_t dream_window_begin(struct dream_stage * ds, const llama_token * tokens, const uint8_t * loss_mask,
    #                            int32_t n, struct dream_receipt * receipt);
    L.dream_window_begin.argtypes = [p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint8),
                                     ctypes.c_int32, R]
    L.dream_window_begin.restype = ctypes.c_int32
    # int32_t dream_window_soft_targets(struct dream_stage * ds, const int32_t * ids, const float * probs,
    #                                   int32_t k, int32_t n_rows, struct dream_receipt * receipt);
    L.dream_window_soft_targets.argtypes = [p, ctypes.POINTER(ctypes.c_int32), f32p, ctypes.c_int32, ctypes.c_int32, R]
    L.dream_window_soft_targets.restype = ctypes.c_int32
    # int32_t dream_micro_step(struct dream_stage * ds, struct dream_receipt * receipt);
    L.dream_micro_step.argtypes = [p, R]
    L.dream_micro_step.restype = ctypes.c_int32
    # int32_t dream_group_begin(struct dream_stage * ds, const llama_token * prefix, int32_t n_prefix,
    #     const llama_token * reply_tokens, const uint8_t * reply_mask, const int32_t * reply_lengths,
    #     const float * weights, int32_t n_replies, struct dream_receipt * receipt);
    i32p, u8p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint8)
    L.dream_group_begin.argtypes = [p, i32p, ctypes.c_int32, i32p, u8p, i32p, f32p, ctypes.c_int32, R]
    L.dream_group_begin.restype = ctypes.c_int32
    # int32_t dream_group_reply_losses(const struct dream_stage * ds, double * out, int32_t n);
    L.dream_group_reply_losses.argtypes = [p, ctypes.POINTER(ctypes.c_double), ctypes.c_int32]
    L.dream_group_reply_losses.restype = ctypes.c_int32
    # int32_t dream_chunks_left(const struct dream_stage * ds);
    L.dream_chunks_left.argtypes = [p]
    L.dream_chunks_left.restype = ctypes.c_int32
    _declare_state(L)
    _declare_bank(L)
    _declare_testing(L)


def _declare_state(L: ctypes.CDLL) -> None:
    """The stage's parameters, optimizer and served adapter, and its settings and probes."""
    p, f32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
    # int64_t dream_n_params(const struct dream_stage * ds);
    L.dream_n_params.argtypes = [p]
    L.dream_n_params.restype = ctypes.c_int64
    # int32_t dream_n_pairs(const struct dream_stage * ds);
    L.dream_n_pairs.argtypes = [p]
    L.dream_n_pairs.restype = ctypes.c_int32
    # bool dream_pair_info(const struct dream_stage * ds, int32_t i, int32_t * layer, const char ** target,
    #                      int64_t * n_in, int64_t * n_out);
    L.dream_pair_info.argtypes = [p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_char_p),
                                  ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    L.dream_pair_info.restype = ctypes.c_bool
    # bool dream_gradients(const struct dream_stage * ds, float * out, int64_t n);
    L.dream_gradients.argtypes = [p, f32p, ctypes.c_int64]
    L.dream_gradients.restype = ctypes.c_bool
    # bool dream_get_parameters(const struct dream_stage * ds, float * out, int64_t n);
    L.dream_get_parameters.argtypes = [p, f32p, ctypes.c_int64]
    L.dream_get_parameters.restype = ctypes.c_bool
    # bool dream_set_parameters(struct dream_stage * ds, const float * in, int64_t n);
    L.dream_set_parameters.argtypes = [p, f32p, ctypes.c_int64]
    L.dream_set_parameters.restype = ctypes.c_bool
    # int64_t dream_optimizer_state(const struct dream_stage * ds, float * out, int64_t n);
    L.dream_optimizer_state.argtypes = [p, f32p, ctypes.c_int64]
    L.dream_optimizer_state.restype = ctypes.c_int64
    # bool dream_set_optimizer_state(struct dream_stage * ds, const float * in, int64_t n, int64_t t);
    L.dream_set_optimizer_state.argtypes = [p, f32p, ctypes.c_int64, ctypes.c_int64]
    L.dream_set_optimizer_state.restype = ctypes.c_bool
    # int64_t dream_promote(struct dream_stage * ds);
    L.dream_promote.argtypes = [p]
    L.dream_promote.restype = ctypes.c_int64
    # struct llama_adapter_lora * dream_served_adapter(struct dream_stage * ds);
    L.dream_served_adapter.argtypes = [p]
    L.dream_served_adapter.restype = p
    # void dream_set_budget(struct dream_stage * ds, double memory_budget_mib);
    L.dream_set_budget.argtypes = [p, ctypes.c_double]
    L.dream_set_budget.restype = None
    # double dream_held_mib(const struct dream_stage * ds);
    L.dream_held_mib.argtypes = [p]
    L.dream_held_mib.restype = ctypes.c_double
    # bool dream_set_lr(struct dream_stage * ds, float lr);
    L.dream_set_lr.argtypes = [p, ctypes.c_float]
    L.dream_set_lr.restype = ctypes.c_bool
    # int32_t dream_set_horizon(struct dream_stage * ds, int32_t horizon);
    L.dream_set_horizon.argtypes = [p, ctypes.c_int32]
    L.dream_set_horizon.restype = ctypes.c_int32
    # bool dream_set_chunk(struct dream_stage * ds, int32_t chunk);
    L.dream_set_chunk.argtypes = [p, ctypes.c_int32]
    L.dream_set_chunk.restype = ctypes.c_bool
    # int32_t dream_last_n_splits(const struct dream_stage * ds);
    L.dream_last_n_splits.argtypes = [p]
    L.dream_last_n_splits.restype = ctypes.c_int32
    # bool dream_last_step_stoppable(const struct dream_stage * ds);
    L.dream_last_step_stoppable.argtypes = [p]
    L.dream_last_step_stoppable.restype = ctypes.c_bool
    # void dream_set_graph_reuse(struct dream_stage * ds, bool on);
    L.dream_set_graph_reuse.argtypes = [p, ctypes.c_bool]
    L.dream_set_graph_reuse.restype = None
    # int64_t dream_graph_reuses(const struct dream_stage * ds);
    L.dream_graph_reuses.argtypes = [p]
    L.dream_graph_reuses.restype = ctypes.c_int64
    # bool dream_fused_attention(const struct dream_stage * ds);
    L.dream_fused_attention.argtypes = [p]
    L.dream_fused_attention.restype = ctypes.c_bool
    # int32_t dream_gate_devices(const struct dream_stage * ds, struct dream_gate_device * out, int32_t n);
    L.dream_gate_devices.argtypes = [p, ctypes.POINTER(DreamGateDeviceC), ctypes.c_int32]
    L.dream_gate_devices.restype = ctypes.c_int32
    # bool dream_optimizer_on_device(const struct dream_stage * ds);
    L.dream_optimizer_on_device.argtypes = [p]
    L.dream_optimizer_on_device.restype = ctypes.c_bool
    # void dream_set_step_deadline(struct dream_stage * ds, double ms);
    L.dream_set_step_deadline.argtypes = [p, ctypes.c_double]
    L.dream_set_step_deadline.restype = None
    # void dream_set_step_abort(struct dream_stage * ds, double ms);
    L.dream_set_step_abort.argtypes = [p, ctypes.c_double]
    L.dream_set_step_abort.restype = None


def _declare_bank(L: ctypes.CDLL) -> None:
    """Serving's side: the compute buffer it holds, and the adapter bank of mixed batches."""
    p = ctypes.c_void_p
    # size_t dream_serving_compute_bytes(struct llama_context * ctx);
    L.dream_serving_compute_bytes.argtypes = [p]
    L.dream_serving_compute_bytes.restype = ctypes.c_size_t
    # struct dream_bank * dream_bank_init(struct llama_context * ctx, int32_t capacity, int32_t max_rank,
    #                                     char * err, size_t err_size);
    L.dream_bank_init.argtypes = [p, ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
    L.dream_bank_init.restype = p
    # void dream_bank_free(struct dream_bank * bank);
    L.dream_bank_free.argtypes = [p]
    L.dream_bank_free.restype = None
    # int32_t dream_bank_load(struct dream_bank * bank, const char * path, float scale, char * err, size_t err_size);
    L.dream_bank_load.argtypes = [p, ctypes.c_char_p, ctypes.c_float, ctypes.c_char_p, ctypes.c_size_t]
    L.dream_bank_load.restype = ctypes.c_int32
    # bool dream_bank_unload(struct dream_bank * bank, int32_t slot);
    L.dream_bank_unload.argtypes = [p, ctypes.c_int32]
    L.dream_bank_unload.restype = ctypes.c_bool
    # bool dream_bank_set_token_adapters(struct dream_bank * bank, const int32_t * slots, int32_t n,
    #                                    char * err, size_t err_size);
    L.dream_bank_set_token_adapters.argtypes = [p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                                ctypes.c_char_p, ctypes.c_size_t]
    L.dream_bank_set_token_adapters.restype = ctypes.c_bool
    # size_t dream_bank_slot_bytes(const struct dream_bank * bank, int32_t slot);
    L.dream_bank_slot_bytes.argtypes = [p, ctypes.c_int32]
    L.dream_bank_slot_bytes.restype = ctypes.c_size_t
    # size_t dream_bank_total_bytes(const struct dream_bank * bank);
    L.dream_bank_total_bytes.argtypes = [p]
    L.dream_bank_total_bytes.restype = ctypes.c_size_t


def _declare_testing(L: ctypes.CDLL) -> None:
    """The test hooks of dream-testing.h: kernels on plain buffers, for the tests only."""
    p, f32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
    # bool dream_backward_product(int32_t type, const void * w, int64_t n_in, int64_t n_out, const float * dy,
    #                             int64_t n_tok, float * dx);
    L.dream_backward_product.argtypes = [ctypes.c_int32, p, ctypes.c_int64, ctypes.c_int64, f32p, ctypes.c_int64, f32p]
    L.dream_backward_product.restype = ctypes.c_bool
    # bool dream_out_prod_f32(const float * a, int64_t ne0, int64_t nk, int64_t a_k, const float * b, int64_t ne1,
    #                         int64_t b_i, int64_t b_k, float * dst);
    L.dream_out_prod_f32.argtypes = [f32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, f32p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, f32p]
    L.dream_out_prod_f32.restype = ctypes.c_bool
    # bool dream_cpu_get_rows_check(int32_t type, const void * w, int64_t n_embd, int64_t n_rows, const int32_t * ids,
    #                               int64_t n_ids, int32_t n_threads, bool rewrite, float * out, bool * rewritten);
    L.dream_cpu_get_rows_check.argtypes = [ctypes.c_int32, p, ctypes.c_int64, ctypes.c_int64, p, ctypes.c_int64,
                                           ctypes.c_int32, ctypes.c_bool, f32p, ctypes.POINTER(ctypes.c_bool)]
    L.dream_cpu_get_rows_check.restype = ctypes.c_bool
    # bool dream_swiglu_back_check(const float * g, const float * u, const float * w, int64_t n_ff, int64_t n_tok,
    #                              int32_t n_threads, bool fused, float * dg, float * du, int32_t * fused_nodes);
    L.dream_swiglu_back_check.argtypes = [f32p, f32p, f32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                                          ctypes.c_bool, f32p, f32p, ctypes.POINTER(ctypes.c_int32)]
    L.dream_swiglu_back_check.restype = ctypes.c_bool
    # bool dream_cpu_exp_check(const float * x, int64_t n, float * out);
    L.dream_cpu_exp_check.argtypes = [f32p, ctypes.c_int64, f32p]
    L.dream_cpu_exp_check.restype = ctypes.c_bool
