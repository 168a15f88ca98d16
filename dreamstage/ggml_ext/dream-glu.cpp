// The backward of SwiGLU (y = silu(g) * u, llama's feed-forward gate) as one node.
//
// ggml differentiates GGML_OP_GLU (SWIGLU, split form) with four element-wise
// passes over the n_ff x T activations: dy * u, SILU_BACK of that at g, SILU(g)
// computed again, and its product with dy. At Llama-3.2-1B shapes and 2048
// tokens each pass reads or writes 64 MiB tensors, and the four took about 6 ms
// of a 70 ms step on an H200 (bench/results/dream_gpu_profile_h200_2026-12-02_tenth_*.txt:
// SILU, SILU_BACK and 32 of the 97 MULs). One pass reads dy, g and u once and
// writes both gradients:
//
//   s = 1 / (1 + exp(-g)),  dg = (dy * u) * s * (1 + g * (1 - s)),  du = dy * (g / (1 + exp(-g)))
//
// the same expressions ggml's SILU_BACK and SILU evaluate, in the same order.
//
// The node is a GGML_OP_CUSTOM with a CPU implementation here (all threads;
// vectorized in dream-cpu-exp.cpp on AVX-512, whose e^x SILU_BACK used) and
// a CUDA one in cuda/custom-ops.cu: patch 0108 lets ggml-cuda claim custom ops
// that carry our tag in their op params and lets the application take over the
// backward of an op ggml differentiates itself (ggml_set_backward_ext_first).
// Its output is one F32 tensor of twice g's size: dg, then du, each contiguous.

#include "dream-stage.h"
#include "dream-testing.h"

#include "ggml-impl.h"   // ggml_get_op_params_i32, ggml_set_op_params_i32, ggml_custom_op_params

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int GLU_OP_PARAM = 1;   // op params [0] the GLU kind, [1] swapped (ggml.c, ggml_glu_impl)

void swiglu_back_rows(const float * dy, const float * g, const float * u, float * dg, float * du, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float x = g[i];
        const float e = std::exp(-x);
        const float s = 1.0f / (1.0f + e);
        dg[i] = (dy[i] * u[i]) * s * (1.0f + x * (1.0f - s));
        du[i] = dy[i] * (x / (1.0f + e));
    }
}

// the custom op's CPU body: src[0] dy, src[1] g, src[2] u (contiguous, same shape)
void swiglu_back_cpu(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * dy = dst->src[0], * g = dst->src[1], * u = dst->src[2];
    const int64_t n = ggml_nelements(g), nc = g->ne[0], rows = n / nc;
    const int64_t per = (rows + nth - 1) / nth;
    const int64_t r0 = per * ith, r1 = std::min(rows, r0 + per);
    if (r0 >= r1) {
        return;
    }
    const int64_t at = r0 * nc, len = (r1 - r0) * nc;
    const float * pdy = (const float *) dy->data + at, * pg = (const float *) g->data + at, * pu = (const float *) u->data + at;
    float * pdg = (float *) dst->data + at, * pdu = (float *) dst->data + n + at;
    if (!dream_cpu_swiglu_back(pdy, pg, pu, pdg, pdu, len)) {   // AVX-512 (dream-cpu-exp.cpp), else the scalar loop
        swiglu_back_rows(pdy, pg, pu, pdg, pdu, len);
    }
}

// dream_swiglu_back_check's choice for the graph it builds on this thread (false: ggml's
// own backward); every other graph fuses. Per thread, so a check never changes what a
// training graph built on another thread at the same time gets.
thread_local bool fused_glu_on = true;

// a split SWIGLU over plain F32 rows, as llama builds a feed-forward gate
bool handled(const ggml_tensor * t) {
    if (t->op != GGML_OP_GLU || ggml_get_glu_op(t) != GGML_GLU_OP_SWIGLU) {
        return false;
    }
    const ggml_tensor * g = t->src[0], * u = t->src[1];
    return u && ggml_get_op_params_i32(t, GLU_OP_PARAM) == 0 && g->type == GGML_TYPE_F32 && u->type == GGML_TYPE_F32 &&
           t->type == GGML_TYPE_F32 && ggml_are_same_shape(g, u) && ggml_are_same_shape(g, t) &&
           ggml_is_contiguous(g) && ggml_is_contiguous(u);
}

bool claims(const ggml_tensor * t) {
    return handled(t) && fused_glu_on;
}

ggml_tensor * swiglu_back_node(ggml_context * ctx, ggml_tensor * dy, ggml_tensor * g, ggml_tensor * u) {
    ggml_tensor * args[3] = { ggml_is_contiguous(dy) ? dy : ggml_cont(ctx, dy), g, u };
    ggml_tensor * node = ggml_custom_4d(ctx, GGML_TYPE_F32, g->ne[0], g->ne[1], g->ne[2], 2 * g->ne[3], args, 3,
                                        swiglu_back_cpu, GGML_N_TASKS_MAX, nullptr);
    return dream_custom_tagged(node, DREAM_CUSTOM_SWIGLU_BACK);
}

// for a node claims() took
void swiglu_backward(ggml_context * ctx, ggml_tensor * t, ggml_tensor * grad, ggml_tensor ** out) {
    ggml_tensor * g = t->src[0], * u = t->src[1];
    ggml_tensor * node = swiglu_back_node(ctx, grad, g, u);
    ggml_format_name(node, "dream_swiglu_back(%s)", t->name);
    const size_t f = sizeof(float);
    out[0] = ggml_view_4d(ctx, node, g->ne[0], g->ne[1], g->ne[2], g->ne[3], g->nb[1], g->nb[2], g->nb[3], 0);
    out[1] = ggml_view_4d(ctx, node, g->ne[0], g->ne[1], g->ne[2], g->ne[3], g->nb[1], g->nb[2], g->nb[3],
                          (size_t) ggml_nelements(g) * f);
}

// ggml's backward builder asks this for every op it meets (patch 0105 for those
// it does not differentiate, patch 0108 first for those claims() takes over)
bool backward_ext(ggml_context * ctx, ggml_tensor * t, ggml_tensor * grad, ggml_tensor ** out) {
    if (t->op == GGML_OP_GLU) {
        if (!claims(t)) {
            return false;
        }
        swiglu_backward(ctx, t, grad, out);
        return true;
    }
    return dream_soft_rest_backward(ctx, t, grad, out) || dream_fattn_backward(ctx, t, grad, out);
}

// installed once, when the library loads: every backward a dream stage builds asks them
const bool hooks_installed = [] {
    ggml_set_backward_ext(backward_ext);
    ggml_set_backward_ext_first(claims);
    return true;
}();

}  // namespace

void dream_fused_glu_set(bool on) {
    fused_glu_on = on;
}

bool dream_is_swiglu_back(const ggml_tensor * t) {
    return dream_is_custom(t, DREAM_CUSTOM_SWIGLU_BACK);
}

// dream.h: the check of tests/test_cpu_backward.py
bool dream_swiglu_back_check(const float * gv, const float * uv, const float * wv, int64_t n_ff, int64_t n_tok,
                             int32_t n_threads, bool fused, float * dg_out, float * du_out, int32_t * fused_nodes) {
    if (!gv || !uv || !wv || !dg_out || !du_out || !fused_nodes || n_ff < 1 || n_tok < 1 ||
        n_ff * n_tok > (int64_t) 1 << 26 || n_threads < 1) {
        return false;
    }
    const int64_t n = n_ff * n_tok;
    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!cpu) {
        return false;
    }
    if (auto * set_threads = (void (*)(ggml_backend_t, int)) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(ggml_backend_get_device(cpu)), "ggml_backend_set_n_threads")) {
        set_threads(cpu, n_threads);
    }
    fused_glu_on = fused;
    ggml_init_params ip = { 64 * ggml_tensor_overhead() + ggml_graph_overhead_custom(256, true), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * g = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_ff, n_tok);
    ggml_tensor * u = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_ff, n_tok);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_ff, n_tok);
    ggml_set_param(g);
    ggml_set_param(u);
    ggml_tensor * loss = ggml_sum(ctx, ggml_mul(ctx, ggml_swiglu_split(ctx, g, u), w));
    ggml_set_loss(loss);
    ggml_cgraph * gb = ggml_new_graph_custom(ctx, 256, true);
    ggml_build_forward_expand(gb, loss);
    ggml_build_backward_expand(ctx, gb, nullptr);
    fused_glu_on = true;
    ggml_tensor * dg = ggml_graph_get_grad(gb, g), * du = ggml_graph_get_grad(gb, u);
    *fused_nodes = 0;
    for (int i = 0; i < ggml_graph_n_nodes(gb); ++i) {
        *fused_nodes += dream_is_swiglu_back(ggml_graph_node(gb, i));
    }
    bool ok = false;
    ggml_backend_buffer_t buf = dg && du ? ggml_backend_alloc_ctx_tensors(ctx, cpu) : nullptr;
    if (buf) {
        ggml_backend_tensor_set(g, gv, 0, n * sizeof(float));
        ggml_backend_tensor_set(u, uv, 0, n * sizeof(float));
        ggml_backend_tensor_set(w, wv, 0, n * sizeof(float));
        ggml_graph_reset(gb);   // the loss's gradient 1, every other gradient 0
        if (ggml_backend_graph_compute(cpu, gb) == GGML_STATUS_SUCCESS) {
            ggml_backend_tensor_get(dg, dg_out, 0, n * sizeof(float));
            ggml_backend_tensor_get(du, du_out, 0, n * sizeof(float));
            ok = true;
        }
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    ggml_backend_free(cpu);
    return ok;
}
