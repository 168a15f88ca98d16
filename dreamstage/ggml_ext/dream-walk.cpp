// The plain walk: one micro-step = one chunk of the window, forward and (when
// it has loss tokens) backward, on the resident context's backends through the
// stage's own schedulers (dream-sched.cpp), with the chunk attending to the training cache's prefix. The gradient stops at
// chunk boundaries (the cached prefix is constant); gradients accumulate on
// the host over the window and AdamW updates the shadow adapter at its end.
#include "dream-stage.h"

#include "ggml-backend.h"
#include "ggml-impl.h"   // struct ggml_cgraph: n_leafs for the scheduler capacity check
#include "llama-batch.h"
#include "llama-graph.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

// The stage whose training graph this thread is building (read by the attention hook).
static thread_local dream_stage * g_building = nullptr;
static thread_local int32_t g_hook_calls = 0;

// The unit scalar of dream_unit_mul, one graph input per training graph.
static ggml_tensor * dream_unit(ggml_context * ctx, dream_stage & ds) {
    if (!ds.build.unit) {
        ds.build.unit = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1);
        ggml_set_name(ds.build.unit, "dream_unit");
        ggml_set_input(ds.build.unit);
    }
    return ds.build.unit;
}

// SET's backward views its incoming gradient with the forward strides, which
// is right only for a contiguous gradient, and build_attn_mha hands it a
// permuted one (measured: K/V LoRA gradients off by more than 100% against
// the NumPy oracle). Multiplying by a unit scalar makes MUL's backward write
// a fresh contiguous gradient before SET's backward reads it.
static ggml_tensor * dream_unit_mul(ggml_context * ctx, dream_stage & ds, ggml_tensor * t) {
    return ggml_mul(ctx, t, dream_unit(ctx, ds));
}

// The exact walk's gradient leaves: the cached cells [lo, pos) cast to F32.
// ggml_set_param only takes op-less tensors, and the cast is a CPY node, so
// the flag is set directly: ggml_build_backward_expand treats any flagged node
// as needing a gradient, and the CPY's own backward stops at the cache (which
// needs none). Its gradient is the adjoint of those cells' K (or V).
static ggml_tensor * dream_leaf(ggml_context * ctx, ggml_tensor * cached, int32_t lo, int32_t pos, const char * name,
                                int32_t il) {
    ggml_tensor * cells = ggml_view_3d(ctx, cached, cached->ne[0], cached->ne[1], pos - lo, cached->nb[1], cached->nb[2],
                                       (size_t) lo * cached->nb[2]);
    ggml_tensor * leaf = ggml_cast(ctx, cells, GGML_TYPE_F32);
    leaf->flags |= GGML_TENSOR_FLAG_PARAM;
    ggml_format_name(leaf, "%s-%d", name, il);
    return leaf;
}

// K for attention: the cache's cells [0, n_kv) cast to F32 (constants), with
// the chunk's own F32 K written over cells [pos, pos + n) so its gradient flows.
// In the exact walk's reverse pass cells [lo, pos) are set in as gradient
// leaves too. Layout [head_dim, n_head_kv, n_kv], as the cache's own view.
static ggml_tensor * dream_join_k(ggml_context * ctx, dream_stage & ds, ggml_tensor * cached, ggml_tensor * k_cur,
                                  int32_t pos, int32_t il) {
    ggml_tensor * base = ggml_cast(ctx, cached, GGML_TYPE_F32);
    const int32_t lo = ds.build.leaf_lo;
    if (lo >= 0 && lo < pos) {
        ggml_tensor * leaf = dream_leaf(ctx, cached, lo, pos, "dream_leaf_k", il);
        ds.build.leaf_k[il] = leaf;
        base = ggml_set(ctx, base, leaf, base->nb[1], base->nb[2], base->nb[3], (size_t) lo * base->nb[2]);
    }
    ggml_tensor * own = ggml_is_contiguous(k_cur) ? k_cur : ggml_cont(ctx, k_cur);
    ggml_tensor * joined = ggml_set(ctx, base, own, base->nb[1], base->nb[2], base->nb[3], (size_t) pos * base->nb[2]);
    return dream_unit_mul(ctx, ds, joined);
}

// V for attention, the same join, but handed over transposed (cells fastest,
// ne [n_kv, n_head_kv, head_dim] with nb[1] > nb[2]): build_attn_mha then
// multiplies it without its own transpose, whose backward would give a
// gradient no CPU binary op accepts.
static ggml_tensor * dream_join_v(ggml_context * ctx, dream_stage & ds, ggml_tensor * cached, ggml_tensor * v_cur,
                                  int32_t pos, int32_t il) {
    // [head_dim, n_head_kv, cells] -> contiguous [cells, head_dim, n_head_kv]
    ggml_tensor * base = ggml_cont(ctx, ggml_permute(ctx, ggml_cast(ctx, cached, GGML_TYPE_F32), 1, 2, 0, 3));
    const int32_t lo = ds.build.leaf_lo;
    if (lo >= 0 && lo < pos) {
        ggml_tensor * leaf = dream_leaf(ctx, cached, lo, pos, "dream_leaf_v", il);
        ds.build.leaf_v[il] = leaf;
        ggml_tensor * leaf_t = ggml_cont(ctx, ggml_permute(ctx, leaf, 1, 2, 0, 3));
        base = ggml_set(ctx, base, leaf_t, base->nb[1], base->nb[2], base->nb[3], (size_t) lo * base->nb[0]);
    }
    ggml_tensor * own = ggml_cont(ctx, ggml_permute(ctx, v_cur, 1, 2, 0, 3));
    ggml_tensor * joined = ggml_set(ctx, base, own, base->nb[1], base->nb[2], base->nb[3], (size_t) pos * base->nb[0]);
    return ggml_permute(ctx, dream_unit_mul(ctx, ds, joined), 0, 2, 1, 3);
}

// [a, b) cut where it wraps around the adjoint buffers' slots (q % adj_rows).
struct dream_ring_piece {
    int32_t pos, slot, len;
};

static std::vector<dream_ring_piece> dream_ring_pieces(const dream_stage & ds, int32_t a, int32_t b) {
    std::vector<dream_ring_piece> out;
    while (a < b) {
        const int32_t slot = a % ds.mem.adj_rows;
        const int32_t len = std::min(b - a, ds.mem.adj_rows - slot);
        out.push_back({ a, slot, len });
        a += len;
    }
    return out;
}

// The slots of [pos, pos + len) in one layer's adjoint buffer.
static ggml_tensor * dream_adj_view(ggml_context * ctx, ggml_tensor * adj, int32_t slot, int32_t len) {
    return ggml_view_3d(ctx, adj, adj->ne[0], adj->ne[1], len, adj->nb[1], adj->nb[2], (size_t) slot * adj->nb[2]);
}

// Positions [from, from + len) of a contiguous [.., .., cells] tensor whose first cell is `first`.
static ggml_tensor * dream_cells_view(ggml_context * ctx, ggml_tensor * t, int32_t first, int32_t from, int32_t len) {
    return ggml_view_3d(ctx, t, t->ne[0], t->ne[1], len, t->nb[1], t->nb[2], (size_t) (from - first) * t->nb[2]);
}

// The exact walk's surrogate for layer il: sum(k_cur * gK) + sum(v_cur * gV)
// over the chunk's own cells, gK and gV constant. Its gradient with respect to
// k_cur and v_cur is the adjoint the later chunks sent back, so backward
// carries their loss into this chunk's parameters and its own ancestors.
static void dream_add_surrogate(ggml_context * ctx, dream_stage & ds, ggml_tensor * k_cur, ggml_tensor * v_cur,
                                int32_t pos, int32_t il) {
    ggml_tensor * cur[2] = { k_cur, v_cur };
    ggml_tensor * adj[2] = { ds.mem.adj_k[il], ds.mem.adj_v[il] };
    for (int i = 0; i < 2; ++i) {
        ggml_tensor * own = ggml_is_contiguous(cur[i]) ? cur[i] : ggml_cont(ctx, cur[i]);
        for (const auto & pc : dream_ring_pieces(ds, pos, pos + (int32_t) own->ne[2])) {
            ggml_tensor * term = ggml_sum(ctx, ggml_mul(ctx, dream_cells_view(ctx, own, pos, pc.pos, pc.len),
                                                        dream_adj_view(ctx, adj[i], pc.slot, pc.len)));
            ds.build.sur = ds.build.sur ? ggml_add(ctx, ds.build.sur, term) : term;
        }
    }
}

bool dream_hook_training_kv(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx, int32_t il,
                            ggml_tensor * k_cur, ggml_tensor * v_cur, ggml_tensor * k_idxs, ggml_tensor * v_idxs,
                            ggml_tensor ** k, ggml_tensor ** v) {
    dream_stage * ds = g_building;
    if (!ds || !mctx || !k_cur || !v_cur) {
        return false;
    }
    ++g_hook_calls;
    // the chunk's K/V become constants for the chunks after it
    ggml_build_forward_expand(gf, mctx->cpy_k(ctx, k_cur, k_idxs, il));
    ggml_build_forward_expand(gf, mctx->cpy_v(ctx, v_cur, v_idxs, il));
    if (ds->build.surrogate) {
        dream_add_surrogate(ctx, *ds, k_cur, v_cur, ds->build.pos, il);
    }
    if (ds->build.pos == 0 && mctx->get_n_kv() == (uint32_t) k_cur->ne[2]) {
        *k = k_cur;
        *v = v_cur;
        return true;
    }
    *k = dream_join_k(ctx, *ds, mctx->get_k(ctx, il), k_cur, ds->build.pos, il);
    *v = dream_join_v(ctx, *ds, mctx->get_v(ctx, il), v_cur, ds->build.pos, il);
    return true;
}

uint32_t dream_hook_sched_graph_nodes(uint32_t serving_nodes) {
    // forward + backward + gradient nodes of a training graph: measured about
    // 3.2x the forward graph for llama-style blocks; 5x leaves headroom.
    return serving_nodes * 5;
}

// Ops that ggml_compute_backward (ggml.c) differentiates. Anything else on the
// path from a LoRA parameter to the loss would abort inside ggml.
static bool dream_op_has_backward(const ggml_tensor * t) {
    switch (t->op) {
        case GGML_OP_NONE: case GGML_OP_DUP: case GGML_OP_ADD: case GGML_OP_ADD1: case GGML_OP_ACC:
        case GGML_OP_SUB: case GGML_OP_MUL: case GGML_OP_DIV: case GGML_OP_SQR: case GGML_OP_SQRT:
        case GGML_OP_LOG: case GGML_OP_SIN: case GGML_OP_COS: case GGML_OP_SUM: case GGML_OP_SUM_ROWS:
        case GGML_OP_MEAN: case GGML_OP_REPEAT: case GGML_OP_REPEAT_BACK: case GGML_OP_RMS_NORM:
        case GGML_OP_MUL_MAT: case GGML_OP_SCALE: case GGML_OP_SET: case GGML_OP_CPY: case GGML_OP_CONT:
        case GGML_OP_RESHAPE: case GGML_OP_VIEW: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
        case GGML_OP_GET_ROWS: case GGML_OP_DIAG_MASK_INF: case GGML_OP_DIAG_MASK_ZERO:
        case GGML_OP_SOFT_MAX: case GGML_OP_ROPE: case GGML_OP_CROSS_ENTROPY_LOSS:
            return true;
        case GGML_OP_UNARY:
            switch (ggml_get_unary_op(t)) {
                case GGML_UNARY_OP_ABS: case GGML_UNARY_OP_SGN: case GGML_UNARY_OP_NEG: case GGML_UNARY_OP_STEP:
                case GGML_UNARY_OP_RELU: case GGML_UNARY_OP_SILU: case GGML_UNARY_OP_EXP:
                case GGML_UNARY_OP_EXPM1: case GGML_UNARY_OP_SOFTPLUS:
                    return true;
                default:
                    return false;
            }
        case GGML_OP_GLU:
            return ggml_get_glu_op(t) == GGML_GLU_OP_SWIGLU && t->src[1] != nullptr;
        case GGML_OP_FLASH_ATTN_EXT:
            return dream_fattn_differentiable(t);
        case GGML_OP_CUSTOM:
            return dream_is_soft_rest_ce(t);
        default:
            return false;
    }
}

// The first node on a parameter-to-loss path that ggml cannot differentiate, or null.
static const ggml_tensor * dream_find_undifferentiable(ggml_cgraph * g, ggml_tensor * loss) {
    std::unordered_set<const ggml_tensor *> from_param, to_loss;
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        ggml_tensor * n = ggml_graph_node(g, i);
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            const ggml_tensor * s = n->src[j];
            if (s && ((s->flags & GGML_TENSOR_FLAG_PARAM) || from_param.count(s))) {
                from_param.insert(n);
                break;
            }
        }
    }
    std::vector<const ggml_tensor *> stack = { loss };
    while (!stack.empty()) {
        const ggml_tensor * t = stack.back();
        stack.pop_back();
        if (!t || !to_loss.insert(t).second) {
            continue;
        }
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            stack.push_back(t->src[j]);
        }
    }
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        const ggml_tensor * n = ggml_graph_node(g, i);
        if (from_param.count(n) && to_loss.count(n) && n->type != GGML_TYPE_I32 && !dream_op_has_backward(n)) {
            return n;
        }
    }
    return nullptr;
}

// The device whose backend would run a node (an OUT_PROD, or a MUL_MAT) reading
// this quantized weight in place: a non-CPU backend of the stage's scheduler that
// holds the weight's buffer and claims the op (ggml-cuda does through
// ggml_ext/cuda, expanding the weight to F32 in its stream-ordered pool). Null:
// the node would run on the CPU.
static ggml_backend_dev_t dream_quantized_out_prod_device(dream_stage & ds, ggml_tensor * node) {
    const ggml_tensor * w = node->src[0];
    if (!w->buffer || ggml_backend_buffer_is_host(w->buffer)) {
        return nullptr;
    }
    ggml_backend_sched_t s = ds.exec.sched_exec.get();
    for (int b = 0; b < ggml_backend_sched_get_n_backends(s); ++b) {
        ggml_backend_t be = ggml_backend_sched_get_backend(s, b);
        ggml_backend_dev_t dev = ggml_backend_get_device(be);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            continue;
        }
        if (ggml_backend_supports_buft(be, ggml_backend_buffer_get_type(w->buffer)) && ggml_backend_supports_op(be, node)) {
            return dev;
        }
    }
    return nullptr;
}

// On the CPU, a weight whose F32 copy would exceed DREAM_DEQUANT_SLICE (the
// tied output head of the default model: 49152 x 576, 108 MiB) is dequantized
// in row slices instead, each slice's OUT_PROD summed: the same product, with
// one slice's copy alive at a time (the gate measured the whole copy at the
// peak of the head's backward). Returns the sum (an ADD), or null when the
// operands are not the plain 2-D weight and transposed gradient it expects.
constexpr size_t DREAM_DEQUANT_SLICE = 16u << 20;

static ggml_tensor * dream_sliced_out_prod(ggml_context * ctx, ggml_tensor * w, ggml_tensor * grad_t) {
    if ((size_t) ggml_nelements(w) * sizeof(float) <= DREAM_DEQUANT_SLICE || ggml_n_dims(w) != 2 ||
        grad_t->op != GGML_OP_TRANSPOSE || !ggml_is_contiguous(grad_t->src[0]) || ggml_n_dims(grad_t) != 2) {
        return nullptr;
    }
    ggml_tensor * g = grad_t->src[0];   // grad_t = transpose(g), g: [rows of w, n]
    const int64_t per = std::max<int64_t>(1, (int64_t) (DREAM_DEQUANT_SLICE / (w->ne[0] * sizeof(float))));
    ggml_tensor * sum = nullptr;
    for (int64_t r0 = 0; r0 < w->ne[1]; r0 += per) {
        const int64_t rows = std::min(per, w->ne[1] - r0);
        ggml_tensor * w_rows = ggml_view_2d(ctx, w, w->ne[0], rows, w->nb[1], (size_t) r0 * w->nb[1]);
        ggml_tensor * g_rows = ggml_view_2d(ctx, g, rows, g->ne[1], g->nb[1], (size_t) r0 * g->nb[0]);
        ggml_tensor * part = ggml_out_prod(ctx, ggml_cast(ctx, w_rows, GGML_TYPE_F32), ggml_transpose(ctx, g_rows));
        sum = sum ? ggml_add(ctx, sum, part) : part;
    }
    return sum && sum->op == GGML_OP_ADD ? sum : nullptr;
}

// DREAMSTAGE_CUDA_TRAIN_MMQ=1 keeps serving's quantized kernels (8-bit
// activations) in training graphs too: the speed side of the precision choice,
// for measuring it (bench/gpu/run.sh runs both).

// What a product through a quantized weight takes from the device's pool: the
// weight expanded to F32 (cuda/out-prod-dequant.cu, mul-mat-exact.cu), or to F16
// with the F32 operand converted beside it (cuda/mul-mat-f16.cu), whichever is more.
static size_t dream_product_pool_bytes(const ggml_tensor * n) {
    const size_t w = (size_t) ggml_nelements(n->src[0]), x = (size_t) ggml_nelements(n->src[1]);
    return std::max(w * sizeof(float), (w + x) * sizeof(uint16_t) + 4 * sizeof(float));
}

static void dream_pool_need_max(std::vector<std::pair<ggml_backend_dev_t, size_t>> & pool_need, ggml_backend_dev_t dev,
                                size_t bytes) {
    for (auto & [d, b] : pool_need) {
        if (d == dev) {
            b = std::max(b, bytes);
            return;
        }
    }
    pool_need.push_back({ dev, bytes });
}

// A host OUT_PROD through a frozen quantized weight n->src[0], rewritten in place (dream_fit_backward).
static void dream_fit_quantized_out_prod(ggml_context * ctx, ggml_tensor * n) {
    ggml_tensor * w = n->src[0];
    ggml_tensor * dyt = n->src[1];
    ggml_tensor * dy = dyt->op == GGML_OP_TRANSPOSE ? dyt->src[0] : ggml_transpose(ctx, dyt);
    if (dream_cpu_wt_dy_supported(w, dy)) {
        // the blocked kernel of dream-cpu-backward.cpp computes the same
        // product with no F32 copy of W; the node becomes that op in
        // place, so its users and shape stay
        dream_take_op(n, dream_cpu_wt_dy(ctx, w, dy));
        // The old transposed view of dy stays in the graph; without a
        // reader it would never release dy, and the allocator would keep
        // every such gradient to the end of the graph (measured: 100 MiB
        // more at chunk 256 with recompute). The op ignores this source.
        if (dyt != dy && !n->src[2]) {
            n->src[2] = dyt;
        }
    } else if (ggml_tensor * sum = dream_sliced_out_prod(ctx, w, dyt)) {
        // n becomes the last partial sum's ADD, so its readers are unchanged
        n->op = GGML_OP_ADD;
        std::memset(n->op_params, 0, sizeof(n->op_params));
        n->src[0] = sum->src[0];
        n->src[1] = sum->src[1];
    } else {
        n->src[0] = ggml_cast(ctx, w, GGML_TYPE_F32);
    }
}

// Rewrites the backward graph so each node can run where its data lives:
// - OUT_PROD(W_q, dy^T), the input gradient through a frozen quantized weight:
//   ggml's CPU kernel dequantizes a row of W for every (token, row) pair, n_tokens
//   times the weight per step (measured 17 s for a 64-token micro-step of the
//   default model). On the CPU the node becomes our blocked kernel
//   (dream-cpu-backward.cpp), which dequantizes each weight once per step into
//   cache-sized panels; a weight it cannot take is cast to F32 right before its
//   OUT_PROD (the allocator frees the copy after its single use), in row slices
//   when the copy would be large (dream_sliced_out_prod). On a GPU backend that
//   takes the quantized op, W stays quantized and the
//   backend expands it in its pool; *pool_need gets, per device, the largest
//   such expansion (4 bytes per weight), which the allocator does not see.
// - MUL_MAT through a GPU-resident quantized weight: annotated F32 for src1 and
//   the accumulator, so the backend multiplies the dequantized weight (expanded
//   in the same pool, counted the same way) instead of rounding the activations
//   to 8 bits. ggml-cuda's kernels land 5.3e-3 from the exact product for Q8_0,
//   Q4_0, Q5_0, Q3_K, Q6_K (as the CPU's do), 1.0e-2 to 1.3e-2 for the types with
//   a per-block minimum (Q4_1, Q2_K, Q4_K, Q5_K) and for Q4_0/Q5_0 at 8 tokens or
//   fewer; the annotated product lands 2.9e-4 (TF32) for every type, at no
//   measured cost in step speed (bench/gpu/dream_op_check, docs/architecture/gpu.md).
// - F32 OUT_PROD (attention's backward, the LoRA factors' gradients) when the
//   whole graph runs on the CPU: the register-tiled kernel of
//   dream-cpu-out-prod.cpp, in place; an F32 MUL_MAT's src1 view (attention's
//   Q, permuted per head) is made contiguous for ggml-cpu's GEMM;
//   CROSS_ENTROPY_LOSS and SILU_BACK, whose ggml ops call expf per element,
//   become dream-cpu-exp.cpp's vectorized kernels.
// - GET_ROWS_BACK of the output rows on a GPU: a scatter (SET_ROWS into
//   zeros), since the rows are distinct.
// - GET_ROWS of the host-resident token embeddings: the same rows on every CPU
//   thread (dream-cpu-rows.cpp); ggml-cpu gives the op one task, 12.5 ms of a
//   2048-token step for Q6_K embeddings.
// - ACC whose added tensor is not contiguous (VIEW's backward fed by a permuted
//   gradient): ggml-cuda's ACC takes contiguous operands only, so the scheduler
//   would run it on the CPU, one round trip per block. A CONT first keeps it on
//   the device; the values are the same.
// Returns the rebuilt graph (the same one when nothing changed).
static ggml_cgraph * dream_fit_backward(dream_stage & ds, ggml_context * ctx, ggml_cgraph * gb, size_t cap,
                                        std::vector<std::pair<ggml_backend_dev_t, size_t>> & pool_need) {
    bool any = false;
    // F32 OUT_PRODs become the CPU kernel only when every node runs on the CPU
    // (a GPU backend's OUT_PROD is cuBLAS already)
    bool cpu_only = true;
    for (int b = 0; b < ggml_backend_sched_get_n_backends(ds.exec.sched_exec.get()); ++b) {
        ggml_backend_dev_t dev = ggml_backend_get_device(ggml_backend_sched_get_backend(ds.exec.sched_exec.get(), b));
        cpu_only = cpu_only && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    }
    for (int i = 0; i < ggml_graph_n_nodes(gb); ++i) {
        ggml_tensor * n = ggml_graph_node(gb, i);
        if (n->op == GGML_OP_OUT_PROD && ggml_is_quantized(n->src[0]->type)) {
            if (ggml_backend_dev_t dev = dream_quantized_out_prod_device(ds, n)) {
                dream_pool_need_max(pool_need, dev, dream_product_pool_bytes(n));
                continue;
            }
            dream_fit_quantized_out_prod(ctx, n);
            any = true;
        } else if (n->op == GGML_OP_MUL_MAT && ggml_is_quantized(n->src[0]->type) && !ds.switches.cuda_train_mmq &&
                   n->src[0]->buffer && ggml_backend_buffer_get_usage(n->src[0]->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS) {
            if (ggml_backend_dev_t dev = dream_quantized_out_prod_device(ds, n)) {
                ggml_prec_set_acc(n, GGML_PREC_F32);
                ggml_prec_set_src(n, GGML_PREC_F32, 1);
                dream_pool_need_max(pool_need, dev, dream_product_pool_bytes(n));
            }
        } else if (n->op == GGML_OP_MUL_MAT && n->src[0]->type == GGML_TYPE_F32 && !cpu_only) {
            // an F32 product keeps F32 all the way in the FP32 mode: ggml-cuda's
            // small-batch kernel (up to 16 columns) would multiply in TF32 whatever
            // NVIDIA_TF32_OVERRIDE says (cuda/mul-mat-exact.cu sends it to cuBLAS)
            ggml_prec_set_src(n, GGML_PREC_F32, 1);
        } else if (n->op == GGML_OP_OUT_PROD && cpu_only && dream_cpu_out_prod_supported(n)) {
            dream_cpu_out_prod_rewrite(ctx, n);
            any = true;
        } else if (n->op == GGML_OP_MUL_MAT && cpu_only && n->src[0]->type == GGML_TYPE_F32 &&
                   n->src[1]->type == GGML_TYPE_F32 && !ggml_is_contiguous(n->src[1])) {
            // ggml-cpu's GEMM (llamafile's) takes a contiguous src1 only; a view
            // (attention's Q, permuted per head) goes to a dot product per
            // output instead, 5x slower at chunk 256. The copy is cheap.
            n->src[1] = ggml_cont(ctx, n->src[1]);
            any = true;
        } else if ((n->op == GGML_OP_CROSS_ENTROPY_LOSS || n->op == GGML_OP_SILU_BACK) && cpu_only &&
                   dream_cpu_exp_ops_rewrite(ctx, n)) {
            any = true;
        } else if (n->op == GGML_OP_GET_ROWS_BACK && !cpu_only && n->src[1] && ggml_n_dims(n) <= 2 &&
                   std::strcmp(ggml_get_name(n->src[1]), "out_ids") == 0) {
            // llama's output rows are distinct positions, so this scatter-add
            // is a plain scatter: zeros, the rows set, copied into n.
            // ggml-cuda's GET_ROWS_BACK sums over every index for every
            // destination row (3.5 ms at 2048 rows on an H200).
            ggml_tensor * zeros = ggml_fill_inplace(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n->ne[0], n->ne[1]), 0.0f);
            dream_take_op(n, ggml_cont(ctx, ggml_set_rows(ctx, zeros, n->src[0], n->src[1])));
            any = true;
        } else if (n->op == GGML_OP_ACC && !ggml_is_contiguous(n->src[1])) {
            n->src[1] = ggml_cont(ctx, n->src[1]);
            any = true;
        } else if (n->op == GGML_OP_GET_ROWS && dream_cpu_get_rows_rewrite(ctx, n)) {
            // (no new node: the graph keeps its order)
        }
    }
    if (!any) {
        return gb;
    }
    // re-expand in the original order: each new node lands just before its user
    ggml_cgraph * out = ggml_new_graph_custom(ctx, cap, false);
    for (int i = 0; i < ggml_graph_n_nodes(gb); ++i) {
        ggml_build_forward_expand(out, ggml_graph_node(gb, i));
    }
    return out;
}

namespace {
// Frees the backward context and ends the graph's use of the stage's scheduler
// on every exit path but one: a step whose graph the stage keeps for the next
// chunk of its shape (keep; the context then belongs to ds.exec.step_graph).
struct dream_graph_scope {
    dream_stage & ds;
    ggml_context * ctx = nullptr;
    int32_t revert_from = -1;   // training-cache cells to drop on failure
    bool keep = false;
    explicit dream_graph_scope(dream_stage & d) : ds(d) {}
    ~dream_graph_scope() {
        g_building = nullptr;
        if (!keep) {
            dream_step_graph_drop(ds);   // the scheduler's allocation goes: a kept graph with it
            dream_sched_release(ds);
        }
        if (revert_from >= 0) {
            ds.mem.cache->seq_rm(0, revert_from, -1);
        }
        if (ctx) {
            ggml_free(ctx);
        }
    }
};
}

// A window the exact walk runs (one without loss tokens is forward only, as in
// the plain walk); a shared-prefix group always does (dream-groups.cpp).
static bool dream_exact_window(const dream_stage & ds) {
    return (ds.params.exact && ds.win.n_masked > 0) || ds.group.active;
}

// The reverse pass's chunk that ends at e starts on the chunk grid (which
// follows the chunk in use, so a smaller chunk after a refusal just continues).
static int32_t dream_rev_start(const dream_stage & ds, int32_t e) {
    return ((e - 1) / ds.params.chunk) * ds.params.chunk;
}

// Moves rev_end past chunks with nothing to carry back (no loss rows, no adjoint).
static void dream_rev_skip(dream_stage & ds) {
    while (ds.win.rev_end > 0) {
        const int32_t s = dream_rev_start(ds, ds.win.rev_end);
        if (dream_loss_rows(ds, s, ds.win.rev_end) > 0 || dream_has_adjoint(ds, s, ds.win.rev_end)) {
            return;
        }
        ds.win.rev_end = s;
    }
}

// The exact walk: the forward sweep fills the cache up to where the reverse
// pass's next chunk starts (that chunk runs forward and backward in one
// graph); the reverse pass then walks back from the last loss token to 0. The
// cache holds [0, win.pos): a reverse chunk gives up its own cells, so a
// smaller chunk after a refusal first refills the cells it now needs.
static dream_chunk dream_next_chunk(dream_stage & ds) {
    if (ds.group.active) {
        return dream_group_next_chunk(ds);
    }
    dream_chunk c;
    if (!dream_exact_window(ds)) {
        c.p = ds.win.pos;
        c.n = std::min(ds.params.chunk, ds.win.n - c.p);
        return c;
    }
    const int32_t end = ds.win.reverse ? ds.win.rev_end : ds.win.loss_end;
    const int32_t start = dream_rev_start(ds, end);
    if (ds.win.pos < start) {
        c.p = ds.win.pos;
        c.n = std::min(ds.params.chunk, start - c.p);
        return c;
    }
    dream_reverse_chunk(ds, c, start, end);
    if (c.p > 0) {
        int32_t h = ds.mem.horizon > 0 ? std::min(ds.mem.horizon, c.p) : c.p;
        if (ds.mem.adj_rows > 0) {
            h = std::min(h, ds.mem.adj_rows - c.n);   // the live adjoints must fit the slots
        }
        c.leaf_lo = h > 0 ? c.p - h : -1;
    }
    return c;
}

int32_t dream_walk_chunks_left(const dream_stage & ds) {
    if (!ds.win.active) {
        return 0;
    }
    if (ds.group.active) {
        return dream_group_chunks_left(ds);
    }
    const int32_t ch = ds.params.chunk;
    if (!dream_exact_window(ds)) {
        return (ds.win.n - ds.win.pos + ch - 1) / ch;
    }
    // an upper bound: the forward chunks still to fill, then every reverse chunk
    const int32_t end = ds.win.reverse ? ds.win.rev_end : ds.win.loss_end;
    const int32_t fwd = (std::max(0, dream_rev_start(ds, end) - ds.win.pos) + ch - 1) / ch;
    return std::max(1, fwd + (end + ch - 1) / ch);
}

// After a refused reverse-pass chunk: halve the horizon in whole chunks (not
// below one chunk), so the retry builds fewer gradient leaves. Returns the new
// horizon, or 0 when it cannot shrink.
static int32_t dream_halve_horizon(dream_stage & ds, int32_t p, int32_t leaf_lo) {
    const int32_t ch = ds.params.chunk;
    const int32_t in_use = p - leaf_lo;
    if (leaf_lo < 0 || in_use <= ch) {
        return 0;
    }
    ds.mem.horizon = std::max(ch, (in_use / 2) / ch * ch);
    return ds.mem.horizon;
}

// When a micro-step that began at t_start is stopped (dream_set_step_deadline).
static dream_deadline_t dream_step_deadline(const dream_stage & ds, std::chrono::steady_clock::time_point t_start) {
    return t_start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double, std::milli>(ds.exec.step_deadline_ms));
}

// After a step's graph computed: the device pools it grew, its loss and its gradient.
static bool dream_step_read(dream_stage & ds, dream_receipt & r, dream_step_graph & sgraph, bool train, bool need_opt_state) {
    for (const auto & [dev, bytes] : sgraph.pool_need) {
        bool found = false;
        for (auto & [d, b] : ds.exec.pool_held) {
            if (d == dev) {
                b = std::max(b, bytes);
                found = true;
            }
        }
        if (!found) {
            ds.exec.pool_held.push_back({ dev, bytes });
        }
    }

    if (train) {
        float ce_val = 0.0f;
        if (sgraph.ce) {
            ggml_backend_tensor_get(sgraph.ce, &ce_val, 0, sizeof(ce_val));
        }
        r.loss = (double) ce_val;
        if (need_opt_state && !dream_opt_create(ds)) {
            dream_receipt_message(r, "allocating the optimizer state (%.2f MiB) failed", 3.0 * (double) ds.lora.n_params * sizeof(float) / DREAM_MIB);
            return false;
        }
        if (!dream_opt_accumulate(ds, sgraph.param_grads)) {
            dream_receipt_message(r, "adding the step's gradients into the accumulator failed");
            return false;
        }
    }
    return true;
}

// The walk moves past a computed chunk: the step count, the window's position,
// a group's or the exact walk's bookkeeping, the window's end and the optimizer.
static void dream_step_advance(dream_stage & ds, dream_receipt & r, const dream_chunk & chunk) {
    const int32_t p = chunk.p, n = chunk.n;
    ds.step += 1;
    ds.win.pos = p + n;
    bool window_done = !dream_exact_window(ds) && ds.win.pos >= ds.win.n;
    if (ds.group.active) {
        window_done = dream_group_chunk_done(ds, chunk, r);
    } else if (chunk.backward_pass) {
        // the leaves' cells now hold adjoints; this chunk's own slots are
        // spent and must read zero when lower positions wrap onto them
        for (int32_t i = std::max(chunk.leaf_lo, 0); chunk.leaf_lo >= 0 && i < p; ++i) {
            ds.win.adj[i] = 1;
        }
        if (ds.mem.adj_rows > 0 && ds.mem.adj_rows < ds.win.n) {
            for (const auto & pc : dream_ring_pieces(ds, p, p + n)) {
                for (auto * adj : { &ds.mem.adj_k, &ds.mem.adj_v }) {
                    for (ggml_tensor * t : *adj) {
                        if (t) {
                            ggml_backend_tensor_memset(t, 0, (size_t) pc.slot * t->nb[2], (size_t) pc.len * t->nb[2]);
                        }
                    }
                }
            }
        }
        ds.win.rev_end = p;
        dream_rev_skip(ds);
        window_done = ds.win.rev_end == 0;
    }
    if (window_done) {
        ds.win.active = false;
        if (ds.win.n_masked > 0 && dream_opt_ready(ds)) {
            ds.opt.windows_pending += 1;
            if (ds.opt.windows_pending >= ds.params.accumulate_windows) {
                if (!dream_opt_update(ds)) {
                    dream_receipt_message(r, "the optimizer update on the adapter's device failed");
                }
                ds.opt.windows_pending = 0;
            }
        }
    }
}

void dream_suspended_drop(dream_stage & ds) {
    if (!ds.exec.suspended.active) {
        return;
    }
    ds.mem.cache->seq_rm(0, ds.exec.suspended.chunk.p, -1);
    ds.win.pos = std::min(ds.win.pos, ds.exec.suspended.chunk.p);
    ds.exec.suspended = dream_suspended_step{};
    dream_step_graph_drop(ds);
    dream_sched_release(ds);
}

namespace {
// One micro-step in progress: what the end of its receipt needs (dream_step_finish).
struct dream_step_run {
    std::chrono::steady_clock::time_point t_start;
    dream_chunk chunk;
    bool walk_new = false;   // the adjoint buffers were allocated by this micro-step
};

// What a chunk's graph computes (dream_step_plan_chunk): its loss rows and the graph's shape.
struct dream_step_shape {
    std::vector<int32_t> targets;   // row i (input p+i): the token it predicts with loss, or -1
    int32_t n_loss = 0;
    int32_t n_out = 1;              // logits rows: the loss rows, or one
    bool train = false;             // the step goes backward
    bool soft = false;              // labels from dream_window_soft_targets (dream-soft.cpp)
    bool soft_rest = false;         // ... whose rows leave mass out: dream_soft_rest_ce
    float loss_scale = 0.0f;        // this chunk's share of the window's mean loss (times a group reply's weight)
};
}

// Ends a micro-step's receipt with status; a refused or failed step frees the adjoint buffers it made.
static int32_t dream_step_finish(dream_stage & ds, dream_receipt & r, const dream_step_run & run, int32_t status) {
    r.status = status;
    if (status != DREAM_STATUS_OK && run.walk_new) {
        if (status == DREAM_STATUS_REFUSED) {
            const size_t len = std::strlen(r.message);
            std::snprintf(r.message + len, sizeof(r.message) - len,
                          "; the job held the exact walk's adjoint buffers for it (%d positions, walk_mib %.2f), freed again",
                          ds.mem.adj_rows, (double) ds.mem.walk_bytes / DREAM_MIB);
        }
        dream_walk_free(ds);   // a refused or failed step leaves nothing allocated
    }
    const dream_chunk & chunk = run.chunk;
    if (status == DREAM_STATUS_REFUSED && chunk.backward_pass && !ds.group.active) {
        if (const int32_t h = dream_halve_horizon(ds, chunk.p, chunk.leaf_lo)) {
            const size_t len = std::strlen(r.message);
            std::snprintf(r.message + len, sizeof(r.message) - len, "; horizon halved from %d to %d, the chunk retries",
                          chunk.p - chunk.leaf_lo, h);
            r.horizon = h;   // the receipt names the horizon the retry uses
        }
    }
    r.walk_mib = (double) ds.mem.walk_bytes / DREAM_MIB;
    r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - run.t_start).count();
    r.optimizer_mib = (double) dream_opt_bytes(ds) / DREAM_MIB;
    return status;
}

// Resume: computes on a step stopped at its deadline, with a deadline of its own; a receipt status.
static int32_t dream_step_resume(dream_stage & ds, dream_receipt & r, dream_step_run & run) {
    dream_suspended_step & su = ds.exec.suspended;
    const dream_chunk & chunk = run.chunk = su.chunk;
    r.chunk_pos = chunk.p;
    r.chunk_tokens = chunk.n;
    r.tokens = su.n_loss;
    r.horizon = ds.params.exact ? ds.mem.horizon : -1;
    r.graph_mib = su.graph_mib;
    std::snprintf(r.walk_pass, sizeof(r.walk_pass), "%s", su.train ? "backward" : "forward");
    const dream_deadline_t deadline = dream_step_deadline(ds, run.t_start);
    const ggml_status st = dream_sched_compute(ds, ds.exec.step_graph.gb, su.batched, true, nullptr,
                                               ds.exec.step_deadline_ms > 0 ? &deadline : nullptr, &su.next_node);
    ds.exec.last_step_stoppable = true;            // it stopped once
    if (st == GGML_STATUS_ABORTED) {
        dream_receipt_message(r, "stopped at the step deadline of %.1f ms again, %d of %d graph nodes computed: the "
                              "next micro-step goes on with chunk at %d (%d tokens)", ds.exec.step_deadline_ms,
                              su.next_node, ggml_graph_n_nodes(ds.exec.step_graph.gb), chunk.p, chunk.n);
        return DREAM_STATUS_STOPPED;
    }
    if (st != GGML_STATUS_SUCCESS) {
        dream_suspended_drop(ds);
        dream_receipt_message(r, "computing the rest of a stopped step failed (ggml status %d)", (int) st);
        return DREAM_STATUS_ERROR;
    }
    const dream_suspended_step done = su;
    su = dream_suspended_step{};
    if (!dream_step_read(ds, r, ds.exec.step_graph, done.train, done.need_opt_state)) {
        dream_step_graph_drop(ds);
        dream_sched_release(ds);
        return DREAM_STATUS_ERROR;
    }
    if (done.keepable) {
        ds.exec.step_graph.valid = true;         // kept for the next chunk of its shape
        ds.exec.graph_reuses += done.reuse ? 1 : 0;
    } else {
        dream_step_graph_drop(ds);
        dream_sched_release(ds);
    }
    dream_step_advance(ds, r, chunk);
    return DREAM_STATUS_OK;
}

// Plan: the next chunk into run.chunk, its loss rows and graph shape, and their receipt fields.
static dream_step_shape dream_step_plan_chunk(dream_stage & ds, dream_receipt & r, dream_step_run & run) {
    const dream_chunk & chunk = run.chunk = dream_next_chunk(ds);
    const int32_t p = chunk.p, n = chunk.n;
    r.chunk_pos = p;
    r.chunk_tokens = n;
    r.horizon = ds.params.exact ? ds.mem.horizon : -1;
    r.group_reply = chunk.group_reply;
    if (chunk.group_reply >= 0) {   // a group's walk is exact on any stage, over the whole prefix
        r.exact = true;
        r.horizon = 0;
    }
    // a chunk larger than the adjoint slots were sized for gets fewer leaves:
    // the receipt says how many positions it actually gave gradient
    if (chunk.leaf_lo >= 0 && ds.mem.horizon > 0 && chunk.p - chunk.leaf_lo < std::min(ds.mem.horizon, chunk.p)) {
        r.horizon = chunk.p - chunk.leaf_lo;
    }
    // row i (input token p+i) predicts token p+i+1 when that token carries loss
    // (the exact walk's forward sweep only fills the cache: its loss rows are
    // trained when the reverse pass comes back to them)
    dream_step_shape sh;
    sh.targets.assign(n, -1);
    const bool forward_sweep = dream_exact_window(ds) && !chunk.backward_pass;
    sh.soft = dream_soft_active(ds);
    sh.soft_rest = dream_soft_has_rest(ds);
    for (int32_t i = 0; i < n && !forward_sweep; ++i) {
        const int32_t j = p + i + 1;
        if (j < ds.win.n && ds.win.mask[j]) {
            sh.targets[i] = ds.win.tokens[j];
            ++sh.n_loss;
        }
    }
    r.tokens = sh.n_loss;
    // only the rows with a target get logits (the graph gathers their hidden
    // states before the head, as serving does for its output rows): the head
    // is a [n_vocab, rows] product and tensor, and its rows without a target
    // would be computed for nothing; a chunk without loss rows keeps one
    sh.n_out = std::max(sh.n_loss, 1);
    // the plain walk (and the exact walk's forward sweep) goes backward only
    // for loss rows; a reverse-pass chunk also for the adjoints it carries
    sh.train = sh.n_loss > 0 || (chunk.backward_pass && chunk.surrogate);
    std::snprintf(r.walk_pass, sizeof(r.walk_pass), "%s", sh.train ? "backward" : "forward");
    sh.loss_scale = sh.n_loss > 0 ? (float) sh.n_loss / (float) ds.win.n_masked * ds.win.loss_scale : 0.0f;
    return sh;
}

// Plan: the exact walk's adjoint buffers at its first backward chunk, gated and made; a receipt status.
// The graph reads and writes them, so they exist before it is built: first their own gate (with the
// step's host memory, which the graph's gate counts again), then, held by the job, the graph's gate
// sees the rest of the need; a refusal there frees them again (dream_step_finish).
static int32_t dream_step_walk_buffers(dream_stage & ds, dream_receipt & r, dream_step_run & run, bool train) {
    if (!train || !run.chunk.backward_pass || ds.mem.adj_rows != 0) {
        return DREAM_STATUS_OK;
    }
    // (the job's largest chunk, not this one: a pacer may start small)
    const int32_t rows = ds.mem.horizon > 0
                             ? std::min(ds.params.window, ds.mem.horizon + std::max(ds.mem.chunk_max, ds.params.chunk))
                             : ds.params.window;
    auto needs = dream_walk_bytes_planned(ds, rows);
    double total = 0;
    for (const auto & nd : needs) {
        total += (double) nd.second / DREAM_MIB;
    }
    for (const auto & nd : dream_opt_step_needs(ds, train)) {
        needs.push_back(nd);
    }
    const dream_gate_verdict v = dream_gate_check(ds, needs);
    if (!v.fits) {
        dream_receipt_refused(r, run.chunk.p, run.chunk.n, v.need_mib, v.allowance_mib);
        dream_receipt_message(r, "the exact walk's adjoint buffers (%d positions, walk_mib %.2f) and the step's host "
                              "memory need %.2f MiB on %s, allowance %.2f MiB (budget %.2f MiB, job holds %.2f MiB, "
                              "slack %.2f MiB)%s", rows, total, v.need_mib, v.device.c_str(), v.allowance_mib,
                              ds.params.memory_budget_mib, dream_held_mib(ds), ds.params.slack_mib, v.why.c_str());
        return DREAM_STATUS_REFUSED;
    }
    std::string err;
    if (!dream_walk_create(ds, rows, err)) {
        dream_receipt_message(r, "%s", err.c_str());
        return DREAM_STATUS_ERROR;
    }
    run.walk_new = true;
    run.chunk = dream_next_chunk(ds);   // the same chunk, its leaves bounded by the slots
    return DREAM_STATUS_OK;
}

// Build: places the chunk's cells [p, p + n) in the training cache (scope reverts them on failure); null on error.
static std::unique_ptr<llama_kv_cache_context> dream_step_place(dream_stage & ds, dream_receipt & r, const dream_chunk & c,
                                                                const dream_step_shape & sh, dream_graph_scope & scope) {
    const int32_t p = c.p, n = c.n;
    // a refused earlier try left none
    ds.mem.cache->seq_rm(0, p, -1);
    ds.win.pos = std::min(ds.win.pos, p);
    llama_batch_allocr balloc(ds.model->hparams.n_pos_per_embd());
    llama_ubatch ub = balloc.ubatch_reserve(n, 1);
    for (int32_t i = 0; i < n; ++i) {
        ub.token[i] = ds.win.tokens[p + i];
        ub.pos[i] = p + i;
        ub.n_seq_id[i] = 1;
        ub.seq_id[i] = &ub.seq_id_unq[0];
        // logits only for the rows that carry a loss (the output head is 49,152
        // x n_embd per row, and its backward is a scatter over all of them);
        // a chunk without loss tokens keeps its last row so the graph has one
        ub.output[i] = sh.n_loss > 0 ? sh.targets[i] >= 0 : i == n - 1;
    }
    auto sinfos = ds.mem.cache->prepare({ ub });
    if (sinfos.empty()) {
        dream_receipt_message(r, "the training cache (%d cells) has no room for chunk at %d (%d tokens)", ds.params.window, p, n);
        return nullptr;
    }
    if (!sinfos[0].is_contiguous() || sinfos[0].head() != (uint32_t) p) {
        dream_receipt_message(r, "training cache placed chunk at %d into cell %u, not %d", p, sinfos[0].head(), p);
        return nullptr;
    }
    auto mctx = std::make_unique<llama_kv_cache_context>(ds.mem.cache.get(), sinfos, std::vector<llama_ubatch>{ ub });
    scope.revert_from = p;
    mctx->apply();
    return mctx;
}

// Build: the training graph's parameters over serving's (copied, never changed) for the placed chunk.
static llm_graph_params dream_step_graph_params(dream_stage & ds, const dream_step_shape & sh,
                                                const llama_kv_cache_context & mctx, ggml_backend_sched_t sched) {
    llama_context & lctx = *ds.lctx;
    llama_cparams cp = dream_context_access::cparams(lctx);
    cp.training = true;
    cp.flash_attn = ds.fused_attn;   // ggml has no backward for FLASH_ATTN_EXT; dream-fattn.cpp gives one on CUDA
    cp.auto_fa = false;
    cp.causal_attn = true;
    cp.embeddings = false;
    cp.warmup = false;
    return {
        /*.arch        =*/ ds.model->arch,
        /*.hparams     =*/ ds.model->hparams,
        /*.cparams     =*/ cp,
        /*.ubatch      =*/ mctx.get_ubatch(),
        /*.gtype       =*/ LLM_GRAPH_TYPE_DEFAULT,
        /*.sched       =*/ sched,
        /*.backend_cpu =*/ dream_context_access::backend_cpu(lctx),
        /*.cvec        =*/ dream_context_access::cvec(lctx),
        /*.loras       =*/ &ds.lora.shadow_set,
        /*.mctx        =*/ &mctx,
        /*.cross       =*/ dream_context_access::cross(lctx),
        /*.prec_policy =*/ &ds.model->prec_policy,
        /*.samplers    =*/ {},
        /*.n_outputs   =*/ (uint32_t) sh.n_out,
        /*.cb          =*/ [](const llama_ubatch &, ggml_tensor * cur, const char * name, int il) {
            if (il >= 0) {
                ggml_format_name(cur, "%s-%d", name, il);
            } else {
                ggml_set_name(cur, name);
            }
        },
        /*.res         =*/ ds.exec.res.get(),
    };
}

// Build: the forward graph through the model's builder, the attention hook
// joining the training cache (and the exact walk's leaves); null on error.
static ggml_cgraph * dream_step_build_forward(dream_stage & ds, dream_receipt & r, const dream_chunk & c,
                                              const llm_graph_params & gp, int32_t n_out) {
    const auto & hp = ds.model->hparams;
    g_building = &ds;
    g_hook_calls = 0;
    ds.build.pos = c.p;
    ds.build.unit = nullptr;
    ds.build.leaf_lo = c.leaf_lo;
    ds.build.surrogate = c.surrogate;
    ds.build.leaf_k.assign(hp.n_layer(), nullptr);
    ds.build.leaf_v.assign(hp.n_layer(), nullptr);
    ds.build.sur = nullptr;
    ggml_cgraph * gf = nullptr;
    try {
        gf = ds.model->build_graph(gp);
    } catch (const std::exception & e) {
        dream_receipt_message(r, "building the training graph failed: %s", e.what());
        return nullptr;
    }
    g_building = nullptr;
    uint32_t n_kv_layers = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        n_kv_layers += hp.has_kv(il) ? 1 : 0;
    }
    if (!gf || (uint32_t) g_hook_calls != n_kv_layers) {
        dream_receipt_message(r, "architecture %s did not build its attention through the dream memory (%d of %u layers)",
                              llm_arch_name(ds.model->arch), g_hook_calls, n_kv_layers);
        return nullptr;
    }
    ggml_tensor * logits = ds.exec.res->get_logits();
    if (!logits || logits->ne[0] != ds.model->vocab.n_tokens() || logits->ne[1] != n_out) {
        dream_receipt_message(r, "the training graph has no [n_vocab, %d] logits", n_out);
        return nullptr;
    }
    return gf;
}

// Build: the chunk's scaled loss over its loss rows (labels, cross-entropy) into sgraph.
static ggml_tensor * dream_step_build_loss(dream_stage & ds, ggml_context * cbw, dream_step_graph & sgraph,
                                           const dream_step_shape & sh, ggml_backend_sched_t sched) {
    const int64_t n_vocab = ds.model->vocab.n_tokens();
    const int32_t n_loss = sh.n_loss;
    ggml_tensor * logits = ds.exec.res->get_logits();
    // the logits hold only the rows with a target (ub.output): cross_entropy_loss's backward assumes
    // every row's labels sum to one, so an all-zero row would still push its softmax into the gradient.
    // With a GPU in the scheduler the one-hot labels are made on the device: a zero matrix (FILL, one
    // write) whose n_loss ones are set through SET_ROWS on its flat view, at r * n_vocab + target[r]:
    // only n_loss indices cross from the host, not a dense n_vocab x n_loss matrix. On the CPU alone
    // the host fills the matrix in place. Soft targets are dense rows: always filled on the host.
    ggml_tensor * labels = nullptr;
    if (ggml_backend_sched_get_n_backends(sched) > 1 && !sh.soft) {
        sgraph.target_ids = ggml_new_tensor_1d(cbw, GGML_TYPE_I64, n_loss);
        ggml_set_name(sgraph.target_ids, "dream_target_ids");
        ggml_set_input(sgraph.target_ids);
        ggml_tensor * zeros = ggml_fill_inplace(cbw, ggml_new_tensor_2d(cbw, GGML_TYPE_F32, 1, n_vocab * n_loss), 0.0f);
        ggml_tensor * ones = ggml_fill_inplace(cbw, ggml_new_tensor_2d(cbw, GGML_TYPE_F32, 1, n_loss), 1.0f);
        labels = ggml_reshape_2d(cbw, ggml_set_rows(cbw, zeros, ones, sgraph.target_ids), n_vocab, n_loss);
    } else {
        sgraph.host_labels = ggml_new_tensor_2d(cbw, GGML_TYPE_F32, n_vocab, n_loss);
        ggml_set_name(sgraph.host_labels, "dream_labels");
        ggml_set_input(sgraph.host_labels);
        labels = sgraph.host_labels;
    }
    if (sh.soft_rest) {
        sgraph.host_rest = ggml_new_tensor_1d(cbw, GGML_TYPE_F32, n_loss);
        ggml_set_name(sgraph.host_rest, "dream_soft_rest");
        ggml_set_input(sgraph.host_rest);
        sgraph.ce = dream_soft_rest_ce(cbw, logits, labels, sgraph.host_rest);   // mean over loss rows
    } else {
        sgraph.ce = ggml_cross_entropy_loss(cbw, logits, labels);   // mean over loss rows
    }
    ggml_set_output(sgraph.ce);
    return ggml_scale(cbw, sgraph.ce, sh.loss_scale);
}

// Build: the exact walk adds each leaf's gradient into gK/gV at its cells, in this
// graph (the buffers are the stage's, so it persists to the chunks before).
static void dream_step_build_adjoints(dream_stage & ds, ggml_context * cbw, ggml_cgraph * gb, const dream_chunk & c) {
    for (uint32_t il = 0; il < ds.model->hparams.n_layer(); ++il) {
        ggml_tensor * leaves[2] = { ds.build.leaf_k[il], ds.build.leaf_v[il] };
        ggml_tensor * adj[2] = { ds.mem.adj_k.empty() ? nullptr : ds.mem.adj_k[il],
                                 ds.mem.adj_v.empty() ? nullptr : ds.mem.adj_v[il] };
        for (int i = 0; i < 2; ++i) {
            ggml_tensor * g = leaves[i] ? ggml_graph_get_grad(gb, leaves[i]) : nullptr;
            if (!g) {
                continue;
            }
            g = ggml_reshape(cbw, ggml_is_contiguous(g) ? g : ggml_cont(cbw, g), leaves[i]);
            for (const auto & pc : dream_ring_pieces(ds, c.leaf_lo, c.p)) {
                ggml_tensor * slots = dream_adj_view(cbw, adj[i], pc.slot, pc.len);
                ggml_tensor * sum = ggml_add(cbw, slots, dream_cells_view(cbw, g, c.leaf_lo, pc.pos, pc.len));
                ggml_build_forward_expand(gb, ggml_cpy(cbw, sum, slots));
            }
        }
    }
}

// Build: the backward of loss (with the exact walk's surrogate) into sgraph.gb, the
// adapter's gradients marked as outputs, rematerialized when params.recompute; false on error.
static bool dream_step_build_backward(dream_stage & ds, dream_receipt & r, ggml_context * cbw, dream_step_graph & sgraph,
                                      const dream_chunk & c, ggml_tensor * loss, size_t cap) {
    // the exact walk: the later chunks' adjoints enter through the surrogate
    if (ds.build.sur) {
        loss = loss ? ggml_add(cbw, loss, ds.build.sur) : ds.build.sur;
    }
    ggml_set_loss(loss);
    ggml_build_forward_expand(sgraph.gb, loss);
    if (const ggml_tensor * bad = dream_find_undifferentiable(sgraph.gb, loss)) {
        dream_receipt_message(r, "op %s (%s, node %s) has no backward pass in ggml", ggml_op_desc(bad),
                              ggml_op_name(bad->op), bad->name);
        return false;
    }
    const int n_forward = ggml_graph_n_nodes(sgraph.gb);
    ggml_build_backward_expand(cbw, sgraph.gb, nullptr);
    sgraph.loss_grad = ggml_graph_get_grad(sgraph.gb, loss);
    for (auto & pr : ds.lora.pairs) {
        for (ggml_tensor * t : { pr.a_shadow, pr.b_shadow }) {
            ggml_tensor * g = ggml_graph_get_grad(sgraph.gb, t);
            if (g) {
                ggml_set_output(g);
            }
            sgraph.param_grads.push_back(g);
        }
    }
    dream_step_build_adjoints(ds, cbw, sgraph.gb, c);
    if (ds.params.recompute) {
        std::string err;
        sgraph.gb = dream_recompute(cbw, sgraph.gb, n_forward, cap, err);
        if (!sgraph.gb) {
            dream_receipt_message(r, "%s", err.c_str());
            return false;
        }
    }
    return true;
}

// Build: a fresh training graph into sgraph (its context held by scope) and planned;
// needs: what allocating it grows, per device. False on error (the receipt says why).
static bool dream_step_build(dream_stage & ds, dream_receipt & r, const dream_chunk & c, const dream_step_shape & sh,
                             const llm_graph_params & gp, uint32_t sched_nodes, dream_graph_scope & scope,
                             dream_step_graph & sgraph, std::vector<std::pair<ggml_backend_dev_t, size_t>> & needs) {
    ggml_backend_sched_t sched = ds.exec.sched_exec.get();
    dream_step_graph_drop(ds);
    // the graph build may pin nodes to a backend on the scheduler it is given
    // (build_attn without offload_kqv): the exec scheduler, reset, so the pins
    // hold until it allocates the graph
    ggml_backend_sched_reset(sched);
    ds.exec.res->reset();
    ggml_cgraph * gf = dream_step_build_forward(ds, r, c, gp, sh.n_out);
    if (!gf) {
        return false;
    }
    // backward context: loss, labels, gradients, the combined graph
    // ggml_graph_cpy needs a hash set at least as large as the forward graph's
    const size_t cap = std::max<size_t>((size_t) 6 * (ggml_graph_n_nodes(gf) + gf->n_leafs) + 1024, (size_t) gf->size);
    ggml_init_params ip = { ggml_tensor_overhead() * cap + ggml_graph_overhead_custom(cap, true), nullptr, true };
    scope.ctx = ggml_init(ip);
    ggml_context * cbw = scope.ctx;
    sgraph.gb = ggml_new_graph_custom(cbw, cap, sh.train);
    ggml_graph_cpy(gf, sgraph.gb);
    if (sh.train) {
        ggml_tensor * loss = sh.n_loss > 0 ? dream_step_build_loss(ds, cbw, sgraph, sh, sched) : nullptr;
        if (!dream_step_build_backward(ds, r, cbw, sgraph, c, loss, cap)) {
            return false;
        }
    }
    sgraph.gb = dream_fit_backward(ds, cbw, sgraph.gb, cap, sgraph.pool_need);
    if (ggml_graph_n_nodes(sgraph.gb) + sgraph.gb->n_leafs > (int) sched_nodes) {
        dream_receipt_message(r, "the training graph has %d nodes and leaves; the scheduler holds %u",
                              ggml_graph_n_nodes(sgraph.gb) + sgraph.gb->n_leafs, sched_nodes);
        return false;
    }
    // the gate's need: plan a twin of this graph with ggml's allocator on the stage's planning scheduler
    dream_graph_plan plan;
    if (!dream_sched_plan(ds, sgraph.gb, plan)) {
        dream_receipt_message(r, "planning the training graph failed");
        return false;
    }
    needs = plan.needs;
    sgraph.graph_bytes = plan.graph_bytes;
    return true;
}

// Compute: the memory gate over what the step allocates (graph, pool growth, optimizer); false: refused.
static bool dream_step_gate(dream_stage & ds, dream_receipt & r, const dream_chunk & c, const dream_step_graph & sgraph,
                            std::vector<std::pair<ggml_backend_dev_t, size_t>> needs, bool train, bool need_opt_state) {
    // a device pool grows to its largest quantized-weight expansion once and keeps it
    for (const auto & [dev, bytes] : sgraph.pool_need) {
        size_t held = 0;
        for (const auto & [d, b] : ds.exec.pool_held) {
            held = d == dev ? b : held;
        }
        needs.push_back({ dev, bytes > held ? bytes - held : 0 });
    }
    for (const auto & nd : dream_opt_step_needs(ds, train)) {
        needs.push_back(nd);
    }
    r.graph_mib = (double) sgraph.graph_bytes / DREAM_MIB;
    const dream_gate_verdict verdict = dream_gate_check(ds, needs);
    if (verdict.fits) {
        return true;
    }
    r.refused_chunk_pos = c.p;
    r.refused_chunk_tokens = c.n;
    r.refused_need_mib = verdict.need_mib;
    r.refused_allowance_mib = verdict.allowance_mib;
    dream_receipt_message(r, "chunk at %d (%d tokens) needs %.2f MiB more on %s (training graph %.2f MiB planned%s), "
                          "allowance %.2f MiB (budget %.2f MiB, job holds %.2f MiB, slack %.2f MiB)%s",
                          c.p, c.n, verdict.need_mib, verdict.device.c_str(), r.graph_mib,
                          need_opt_state ? " + optimizer state" : "", verdict.allowance_mib,
                          ds.params.memory_budget_mib, dream_held_mib(ds), ds.params.slack_mib, verdict.why.c_str());
    return false;
}

// Compute: the graph's inputs for the placed chunk (ubatch, unit, labels, loss gradient seed).
static void dream_step_set_inputs(dream_stage & ds, const dream_step_graph & sgraph, const dream_step_shape & sh,
                                  int32_t p, const llama_kv_cache_context & mctx) {
    const int64_t n_vocab = ds.model->vocab.n_tokens();
    const int32_t n = (int32_t) sh.targets.size();
    ds.exec.res->set_inputs(&mctx.get_ubatch());
    if (ds.build.unit) {
        const float unit = 1.0f;
        ggml_backend_tensor_set(ds.build.unit, &unit, 0, sizeof(unit));
    }
    if (sgraph.target_ids) {
        std::vector<int64_t> ids;   // the flat index of each loss row's one
        for (int32_t i = 0; i < n; ++i) {
            if (sh.targets[i] >= 0) {
                ids.push_back((int64_t) ids.size() * n_vocab + sh.targets[i]);
            }
        }
        ggml_backend_tensor_set(sgraph.target_ids, ids.data(), 0, ggml_nbytes(sgraph.target_ids));
    }
    if (sgraph.host_labels) {
        // a tensor of the CPU backend: filled where it lies
        GGML_ASSERT(ggml_backend_buffer_is_host(sgraph.host_labels->buffer));
        float * lab = (float *) sgraph.host_labels->data;
        if (sh.soft) {
            float * rest = nullptr;
            if (sgraph.host_rest) {
                GGML_ASSERT(ggml_backend_buffer_is_host(sgraph.host_rest->buffer));
                rest = (float *) sgraph.host_rest->data;
            }
            dream_soft_fill(ds, p, sh.targets, lab, n_vocab, rest);
        } else {
            std::memset(lab, 0, ggml_nbytes(sgraph.host_labels));
            int64_t row = 0;
            for (int32_t i = 0; i < n; ++i) {
                if (sh.targets[i] >= 0) {
                    lab[row++ * n_vocab + sh.targets[i]] = 1.0f;
                }
            }
        }
    }
    if (sgraph.loss_grad) {
        const float one = 1.0f;
        ggml_backend_tensor_set(sgraph.loss_grad, &one, 0, sizeof(one));
    }
}

// Compute: a freshly built graph into the stage's step graph, with what a later step compares.
static void dream_step_keep_fresh(dream_stage & ds, dream_step_graph & fresh, dream_graph_scope & scope,
                                  const dream_chunk & c, const dream_step_shape & sh, bool valid) {
    fresh.ctx.reset(scope.ctx);
    scope.ctx = nullptr;
    fresh.unit = ds.build.unit;
    fresh.p = c.p;
    fresh.n = c.n;
    fresh.n_out = sh.n_out;
    fresh.train = sh.train;
    fresh.soft = sh.soft;
    fresh.soft_rest = sh.soft_rest;
    fresh.loss_scale = sh.loss_scale;
    fresh.valid = valid;
    ds.exec.step_graph = std::move(fresh);
}

// Compute: a stopped step (its graph, inputs and cells kept) becomes ds.exec.suspended; a receipt status.
static int32_t dream_step_suspend(dream_stage & ds, dream_receipt & r, const dream_step_run & run, const dream_step_shape & sh,
                                  dream_step_graph & fresh, dream_graph_scope & scope, bool keepable, bool reuse,
                                  bool need_opt_state, int32_t next_node) {
    const dream_chunk & c = run.chunk;
    if (!reuse) {
        dream_step_keep_fresh(ds, fresh, scope, c, sh, false);   // valid again when the step completes
    }
    ds.exec.step_graph.valid = false;
    ds.exec.suspended = dream_suspended_step{ true, next_node, c, sh.n_loss, sh.train, keepable, reuse, need_opt_state,
                                              c.n > 1, r.graph_mib };
    scope.keep = true;
    scope.revert_from = -1;
    dream_receipt_message(r, "stopped at the step deadline of %.1f ms, %d of %d graph nodes computed: the next "
                          "micro-step goes on with chunk at %d (%d tokens)", ds.exec.step_deadline_ms, next_node,
                          ggml_graph_n_nodes(ds.exec.step_graph.gb), c.p, c.n);
    return DREAM_STATUS_STOPPED;
}

// Compute: allocates the graph once on the exec scheduler (unless reused), computes it, reads the
// step's results and keeps the plain walk's graph for the next chunk of its shape; a receipt status.
static int32_t dream_step_compute(dream_stage & ds, dream_receipt & r, const dream_step_run & run,
                                  const dream_step_shape & sh, dream_step_graph & fresh, bool reuse, bool keepable,
                                  bool need_opt_state, dream_graph_scope & scope, const llama_kv_cache_context & mctx) {
    const dream_chunk & c = run.chunk;
    dream_step_graph & sgraph = reuse ? ds.exec.step_graph : fresh;
    // the step deadline (dream_set_step_deadline): only a graph that writes
    // nothing but this chunk's own cache cells may stop midway and go on later
    const bool stoppable = ds.exec.step_deadline_ms > 0 && !c.backward_pass && c.group_reply < 0;
    const dream_deadline_t deadline = dream_step_deadline(ds, run.t_start);
    int32_t next_node = 0;
    const ggml_status st = dream_sched_compute(ds, sgraph.gb, c.n > 1, reuse,
                                               [&] { dream_step_set_inputs(ds, sgraph, sh, c.p, mctx); },
                                               stoppable ? &deadline : nullptr, &next_node);
    ds.exec.last_step_stoppable = !c.backward_pass && c.group_reply < 0 && ds.exec.last_one_cpu_split;
    if (st == GGML_STATUS_ABORTED && stoppable) {
        return dream_step_suspend(ds, r, run, sh, fresh, scope, keepable, reuse, need_opt_state, next_node);
    }
    if (st == GGML_STATUS_ALLOC_FAILED) {
        dream_receipt_message(r, "allocating the training graph (%.2f MiB) failed", r.graph_mib);
        return DREAM_STATUS_ERROR;
    }
    if (st == GGML_STATUS_FAILED && ds.fused_attn && !dream_fattn_on_cuda(ds.exec.sched_exec.get(), sgraph.gb)) {
        dream_receipt_message(r, "the fused attention backward was scheduled off CUDA; set DREAMSTAGE_FUSED_ATTN=0");
        return DREAM_STATUS_ERROR;
    }
    if (st != GGML_STATUS_SUCCESS) {
        dream_receipt_message(r, "computing the training graph failed (ggml status %d)", (int) st);
        return DREAM_STATUS_ERROR;
    }
    if (!dream_step_read(ds, r, sgraph, sh.train, need_opt_state)) {
        return DREAM_STATUS_ERROR;
    }
    // the plain walk keeps the graph allocated for the next chunk of this shape
    if (keepable) {
        if (!reuse) {
            dream_step_keep_fresh(ds, fresh, scope, c, sh, true);
        } else {
            ds.exec.graph_reuses += 1;
        }
        scope.keep = true;
    }
    scope.revert_from = -1;     // the chunk's K/V stay as constants for later chunks
    dream_step_advance(ds, r, c);
    return DREAM_STATUS_OK;
}

// One micro-step: resume a stopped step, or plan the next chunk, place it,
// build (or reuse) its graph, gate its memory and compute it.
int32_t dream_walk_micro_step(dream_stage & ds, dream_receipt & r) {
    dream_step_run run;
    run.t_start = std::chrono::steady_clock::now();
    dream_receipt_start(ds, r);
    r.step = ds.step + 1;
    if (!ds.win.active || (!dream_exact_window(ds) && ds.win.pos >= ds.win.n)) {
        dream_receipt_message(r, "no window in progress: call dream_window_begin first");
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    if (ds.exec.suspended.active) {
        return dream_step_finish(ds, r, run, dream_step_resume(ds, r, run));
    }
    const dream_step_shape sh = dream_step_plan_chunk(ds, r, run);
    if (ds.model->hparams.n_pos_per_embd() != 1) {
        dream_receipt_message(r, "models with %u positions per token (M-RoPE) are not supported by the dream stage",
                              ds.model->hparams.n_pos_per_embd());
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    if (const int32_t st = dream_step_walk_buffers(ds, r, run, sh.train); st != DREAM_STATUS_OK) {
        return dream_step_finish(ds, r, run, st);
    }
    const dream_chunk & c = run.chunk;
    dream_graph_scope scope(ds);
    const auto mctx = dream_step_place(ds, r, c, sh, scope);
    if (!mctx) {
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    llama_context & lctx = *ds.lctx;
    const uint32_t sched_nodes = lctx.graph_max_nodes(std::min(lctx.n_ctx(), lctx.n_ubatch()));
    if (!dream_sched_ensure(ds, sched_nodes)) {
        dream_receipt_message(r, "could not create the dream stage's schedulers");
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    if (!ds.exec.res) {
        ds.exec.res.reset(new llm_graph_result(sched_nodes));
    }
    const llm_graph_params gp = dream_step_graph_params(ds, sh, *mctx, ds.exec.sched_exec.get());
    // The last step's graph, when this chunk has its shape, is still allocated on the exec
    // scheduler: set its inputs and compute it again (dream_step_graph). Only the plain walk:
    // the exact walk's and a group's graphs carry leaves, adjoint views and surrogates that
    // depend on the chunk's place in the pass.
    const dream_step_graph & sg = ds.exec.step_graph;
    const bool keepable = ds.exec.graph_reuse && !dream_exact_window(ds) && !ds.group.active;
    const bool reuse = keepable && sg.valid && sg.p == c.p && sg.n == c.n && sg.n_out == sh.n_out && sg.train == sh.train &&
                       sg.soft == sh.soft && sg.soft_rest == sh.soft_rest && sg.loss_scale == sh.loss_scale &&
                       ds.exec.res->can_reuse(gp);
    dream_step_graph fresh;   // the graph this step builds, unless it reuses the kept one
    std::vector<std::pair<ggml_backend_dev_t, size_t>> needs;   // what the step allocates, per device
    if (reuse) {
        ds.build.unit = sg.unit;   // allocated already: the gate sees only the step's host memory
    } else if (!dream_step_build(ds, r, c, sh, gp, sched_nodes, scope, fresh, needs)) {
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    const bool need_opt_state = sh.train && !dream_opt_ready(ds);
    if (!dream_step_gate(ds, r, c, reuse ? sg : fresh, needs, sh.train, need_opt_state)) {
        return dream_step_finish(ds, r, run, DREAM_STATUS_REFUSED);
    }
    return dream_step_finish(ds, r, run,
                             dream_step_compute(ds, r, run, sh, fresh, reuse, keepable, need_opt_state, scope, *mctx));
}
