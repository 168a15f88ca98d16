// Fitting a training graph to the backends (dream_fit_backward) and finding
// what ggml cannot differentiate in it, before its backward is built.
#include "dream-walk.h"

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
const ggml_tensor * dream_find_undifferentiable(ggml_cgraph * g, ggml_tensor * loss) {
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
ggml_cgraph * dream_fit_backward(dream_stage & ds, ggml_context * ctx, ggml_cgraph * gb, size_t cap,
                                        std::vector<std::pair<ggml_backend_dev_t, size_t>> & pool_need) {
    bool any = false;
    // F32 OUT_PRODs become the CPU kernel only when every node runs on the CPU
    // (a GPU backend's OUT_PROD is cuBLAS already)
    bool cpu_only = ds.switches.cpu_graph_kernels;
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
