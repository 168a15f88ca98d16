// Fused attention in training graphs on CUDA: FLASH_ATTN_EXT forward, our backward.
//
// A training graph built the explicit way keeps each layer's score matrix
// (T x T per head, F32) from the forward for the backward: at 2048 tokens that
// is most of the graph and a third of the step on the H200 (docs/architecture/gpu.md,
// "Fused attention in training graphs (patch 0105, `dream-fattn.cpp`,
// `cuda/flash-attn-back.cu`)"). When every layer's attention runs on CUDA, the
// dream stage builds its graphs with flash attention on instead (the cparams
// of the graph, never serving's): upstream's FLASH_ATTN_EXT kernel for the
// forward, and for the backward, which ggml does not have, a node of ours:
//
//   - ggml's backward builder asks the hook of patch 0105 (ggml_set_backward_ext,
//     installed by dream-glu.cpp) for ops it does not differentiate;
//     dream_fattn_backward answers for a
//     FLASH_ATTN_EXT without ALiBi, logit soft-capping or sinks;
//   - the answer is one GGML_OP_FLASH_ATTN_BACK node computing dQ, dK and dV
//     into one F32 tensor (cuda/flash-attn-back.cu; ggml-cuda dispatches the op
//     to it through the same patch), and views of it as the three gradients.
//     ggml's own CPU code for that op predates FLASH_ATTN_EXT and reads another
//     layout, so the node must run on CUDA: dream_fattn_on_cuda checks where the
//     scheduler put it before a graph computes.
//
// The forward reads K and V in F16 (FLASH_ATTN_EXT on CUDA takes no F32 K/V;
// llama casts them), the backward multiplies F16 operands (TF32's mantissa, dO
// scaled into F16's range): the precision the check in bench/gpu/dream_gpu_check.cpp
// holds both to. DREAMSTAGE_FUSED_ATTN=0 turns it off.
#include "dream-stage.h"

#include "ggml-impl.h"   // ggml_set_op_params

#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t PAD = 64;   // floats: each part of the backward's output starts 256-byte aligned

int64_t padded(int64_t n) {
    return (n + PAD - 1) / PAD * PAD;
}

bool backend_is_cuda(ggml_backend_dev_t dev) {
    if (!dev || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU) {
        return false;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    return reg && std::strcmp(ggml_backend_reg_name(reg), "CUDA") == 0;
}

// the FLASH_ATTN_EXT nodes the backward below handles (what llama builds for a
// training graph of a model without ALiBi, soft-capping or sinks)
bool handled(const ggml_tensor * t) {
    if (t->op != GGML_OP_FLASH_ATTN_EXT || t->src[4] != nullptr) {
        return false;
    }
    float params[3];
    std::memcpy(params, t->op_params, sizeof(params));   // scale, max_bias, logit_softcap
    const ggml_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * m = t->src[3];
    return params[1] == 0.0f && params[2] == 0.0f && q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 &&
           v->type == GGML_TYPE_F16 && (!m || m->type == GGML_TYPE_F16) && q->ne[3] == 1 && k->ne[3] == 1 &&
           v->ne[0] == q->ne[0] && (q->ne[0] == 64 || q->ne[0] == 128) && k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0;
}

}  // namespace

bool dream_fattn_backward(ggml_context * ctx, ggml_tensor * t, ggml_tensor * grad, ggml_tensor ** out) {
    if (!handled(t)) {
        return false;
    }
    ggml_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2];
    const int64_t D = q->ne[0], T = q->ne[1], H = q->ne[2], Tk = k->ne[1], Hk = k->ne[2];
    const int64_t n_cls = ((T + 63) / 64) * ((Tk + 63) / 64);   // a byte per 64 x 64 tile of the mask
    const int64_t off_k = padded(D * T * H), off_v = off_k + padded(D * Tk * Hk), off_lse = off_v + padded(D * Tk * Hk),
                  off_dvec = off_lse + padded(T * H), off_cls = off_dvec + padded(T * H),
                  total = off_cls + padded((n_cls + 3) / 4 + H);   // the classes, then a word per q head
    GGML_ASSERT(total < INT32_MAX && "fused attention backward: offsets beyond int32");
    ggml_tensor * node = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, total);
    node->op = GGML_OP_FLASH_ATTN_BACK;
    node->src[0] = q;
    node->src[1] = k;
    node->src[2] = v;
    node->src[3] = t->src[3];
    node->src[4] = t;
    node->src[5] = ggml_is_contiguous(grad) ? grad : ggml_cont(ctx, grad);
    int32_t params[6] = { 0, (int32_t) off_k, (int32_t) off_v, (int32_t) off_lse, (int32_t) off_dvec, (int32_t) off_cls };
    std::memcpy(&params[0], t->op_params, sizeof(float));   // the scale
    ggml_set_op_params(node, params, sizeof(params));
    ggml_format_name(node, "dream_fattn_back(%s)", t->name);
    const size_t f = sizeof(float);
    // dQ token-major ([D, H, T] in memory, as Q lay before attention's permute):
    // the permute's backward then hands on a contiguous gradient, where a
    // head-major one needed a strided copy before the ACC of the view in front
    // (1.4 ms of a 2048-token step). dK and dV stay head-major: they reach K and V
    // through the cast to F16, whose backward (CPY's) reshapes the gradient and
    // so takes a contiguous one only.
    out[0] = ggml_view_4d(ctx, node, D, T, H, 1, D * H * f, D * f, D * T * H * f, 0);
    out[1] = ggml_view_4d(ctx, node, D, Tk, Hk, 1, D * f, D * Tk * f, D * Tk * Hk * f, off_k * f);
    out[2] = ggml_view_4d(ctx, node, D, Tk, Hk, 1, D * f, D * Tk * f, D * Tk * Hk * f, off_v * f);
    return true;
}


bool dream_fattn_differentiable(const ggml_tensor * t) {
    return handled(t);
}

bool dream_fattn_usable(const dream_stage & ds) {
    // the FP32 mode (docs/architecture/gpu.md, "Precision") is exact F32 throughout:
    // F16 K/V and F16 (10-bit mantissa) products are not
    if (!ds.switches.fused_attn || ds.switches.fp32_mode) {
        return false;
    }
    const auto & hp = ds.model->hparams;
    if (hp.f_max_alibi_bias != 0.0f || hp.attn_soft_cap || hp.n_embd_head_k() != hp.n_embd_head_v() ||
        (hp.n_embd_head_k() != 64 && hp.n_embd_head_k() != 128) || !dream_context_access::cparams(*ds.lctx).offload_kqv) {
        return false;
    }
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.has_kv(il) && (!backend_is_cuda(ds.model->dev_layer(il)) || hp.n_head_kv(il) == 0 ||
                              hp.n_head(il) % hp.n_head_kv(il) != 0)) {
            return false;
        }
    }
    return true;   // ggml's backward builder reaches dream_fattn_backward through dream-glu.cpp's hook
}

bool dream_fattn_on_cuda(ggml_backend_sched_t sched, ggml_cgraph * g) {
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        ggml_tensor * n = ggml_graph_node(g, i);
        if (n->op == GGML_OP_FLASH_ATTN_BACK) {
            ggml_backend_t b = ggml_backend_sched_get_tensor_backend(sched, n);
            if (!b || !backend_is_cuda(ggml_backend_get_device(b))) {
                return false;
            }
        }
    }
    return true;
}
