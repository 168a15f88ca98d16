// The dream stage's GGML_OP_CUSTOM nodes on CUDA (patch 0108 sends ggml-cuda's
// supports_op and compute for GGML_OP_CUSTOM here). A node is ours when its op
// params carry DREAM_CUSTOM_TAG (dream-hooks.h); the kind after it picks the
// kernel. Any other custom op stays unsupported, so the scheduler gives it to
// the CPU as before.
//
//   DREAM_CUSTOM_SWIGLU_BACK (dream-glu.cpp): SwiGLU's backward in one pass,
//   src dy, g, u (F32, contiguous, one shape), dst dg then du.
//   DREAM_CUSTOM_BANK_SHRINK, _EXPAND (dream-bank.cpp): the adapter bank's
//   per-token LoRA term: u = A[s] x from src x [n_in, n_tok], A [n_in, r, n],
//   ids [1, n_tok] (I32, 0 = no adapter); then y + B[s] u from src y
//   [n_out, n_tok], u [r, n_tok], B [r, n_out, n], ids.

#include "common.cuh"
#include "out-prod.cuh"

#include "../dream-hooks.h"

#include <cstdint>

static int dream_custom_kind(const ggml_tensor * op) {
    const int32_t * p = (const int32_t *) op->op_params;
    return p[DREAM_CUSTOM_TAG_PARAM] == DREAM_CUSTOM_TAG ? p[DREAM_CUSTOM_TAG_PARAM + 1] : 0;
}

// the expressions of ggml's SILU_BACK and SILU (and the CPU body in dream-glu.cpp), in their order
static __device__ __forceinline__ void dream_swiglu_back_one(float dy, float g, float u, float & dg, float & du) {
    const float e = expf(-g);
    const float s = 1.0f / (1.0f + e);
    dg = (dy * u) * s * (1.0f + g * (1.0f - s));
    du = dy * (g / (1.0f + e));
}

static __global__ void dream_swiglu_back_f32x4(const float4 * __restrict__ dy, const float4 * __restrict__ g,
                                               const float4 * __restrict__ u, float4 * __restrict__ dg,
                                               float4 * __restrict__ du, int64_t n4) {
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < n4; i += (int64_t) gridDim.x * blockDim.x) {
        const float4 a = dy[i], b = g[i], c = u[i];
        float4 x, y;
        dream_swiglu_back_one(a.x, b.x, c.x, x.x, y.x);
        dream_swiglu_back_one(a.y, b.y, c.y, x.y, y.y);
        dream_swiglu_back_one(a.z, b.z, c.z, x.z, y.z);
        dream_swiglu_back_one(a.w, b.w, c.w, x.w, y.w);
        dg[i] = x;
        du[i] = y;
    }
}

static __global__ void dream_swiglu_back_f32(const float * __restrict__ dy, const float * __restrict__ g,
                                             const float * __restrict__ u, float * __restrict__ dg,
                                             float * __restrict__ du, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        dream_swiglu_back_one(dy[i], g[i], u[i], dg[i], du[i]);
    }
}

static bool dream_swiglu_back_layout(const ggml_tensor * op) {
    const ggml_tensor * dy = op->src[0], * g = op->src[1], * u = op->src[2];
    return dy && g && u && op->src[3] == nullptr && dy->type == GGML_TYPE_F32 && g->type == GGML_TYPE_F32 &&
           u->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && ggml_are_same_shape(dy, g) &&
           ggml_are_same_shape(g, u) && ggml_is_contiguous(dy) && ggml_is_contiguous(g) && ggml_is_contiguous(u) &&
           ggml_is_contiguous(op) && ggml_nelements(op) == 2 * ggml_nelements(g);
}

// Shrink: u[:, t] = A[s] x[:, t], s = ids[t]. One warp per (rank row, token), 4 warps a block:
// A[s]'s rows are read once per token, not once per block of outputs.
static constexpr int BANK_SHRINK_WARPS = 4;

static __global__ void dream_bank_shrink_f32(const float * __restrict__ x, const float * __restrict__ a,
                                             const int32_t * __restrict__ ids, float * __restrict__ u,
                                             int n_in, int r) {
    const int t = blockIdx.y, s = ids[t];
    const int k = blockIdx.x * BANK_SHRINK_WARPS + threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (k >= r) {
        return;
    }
    float acc = 0.0f;
    if (s != 0) {
        const float * xt = x + (int64_t) t * n_in;
        const float * ak = a + ((int64_t) s * r + k) * n_in;
        if (n_in % 4 == 0 && ((uintptr_t) xt | (uintptr_t) ak) % 16 == 0) {
            const float4 * x4 = (const float4 *) xt, * a4 = (const float4 *) ak;
            for (int i = lane; i < n_in / 4; i += WARP_SIZE) {
                const float4 p = a4[i], q = x4[i];
                acc += p.x * q.x + p.y * q.y + p.z * q.z + p.w * q.w;
            }
        } else {
            for (int i = lane; i < n_in; i += WARP_SIZE) {
                acc += ak[i] * xt[i];
            }
        }
        acc = warp_reduce_sum(acc);
    }
    if (lane == 0) {
        u[(int64_t) t * r + k] = acc;
    }
}

// Expand: out[:, t] = y[:, t] + B[s] u[:, t]. One block per (token, 256 outputs), u in shared memory.
static __global__ void dream_bank_expand_f32(const float * __restrict__ y, const float * __restrict__ u,
                                             const float * __restrict__ b, const int32_t * __restrict__ ids,
                                             float * __restrict__ out, int r, int n_out) {
    extern __shared__ float us[];
    const int t = blockIdx.y, s = ids[t];
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (s != 0) {        // the same for the whole block
        for (int k = threadIdx.x; k < r; k += blockDim.x) {
            us[k] = u[(int64_t) t * r + k];
        }
        __syncthreads();
    }
    if (j >= n_out) {
        return;
    }
    float acc = 0.0f;
    if (s != 0) {
        const float * bj = b + ((int64_t) s * n_out + j) * r;
        for (int k = 0; k < r; ++k) {
            acc += bj[k] * us[k];
        }
    }
    out[(int64_t) t * n_out + j] = acc + y[(int64_t) t * n_out + j];
}

static bool dream_bank_shrink_layout(const ggml_tensor * op) {
    const ggml_tensor * x = op->src[0], * a = op->src[1], * ids = op->src[2];
    return x && a && ids && op->src[3] == nullptr && x->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 &&
           ids->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 && ggml_is_contiguous(x) && ggml_is_contiguous(a) &&
           ggml_is_contiguous(ids) && ggml_is_contiguous(op) && a->ne[0] == x->ne[0] && op->ne[0] == a->ne[1] &&
           op->ne[1] == x->ne[1] && ggml_nelements(ids) == x->ne[1];
}

static bool dream_bank_expand_layout(const ggml_tensor * op) {
    const ggml_tensor * y = op->src[0], * u = op->src[1], * b = op->src[2], * ids = op->src[3];
    return y && u && b && ids && y->type == GGML_TYPE_F32 && u->type == GGML_TYPE_F32 && b->type == GGML_TYPE_F32 &&
           ids->type == GGML_TYPE_I32 && op->type == GGML_TYPE_F32 && ggml_is_contiguous(y) && ggml_is_contiguous(u) &&
           ggml_is_contiguous(b) && ggml_is_contiguous(ids) && ggml_is_contiguous(op) && ggml_are_same_shape(op, y) &&
           b->ne[0] == u->ne[0] && b->ne[1] == y->ne[0] && u->ne[1] == y->ne[1] && ggml_nelements(ids) == y->ne[1];
}

static void dream_bank_shrink(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * x = dst->src[0], * a = dst->src[1], * ids = dst->src[2];
    const int n_in = (int) x->ne[0], n_tok = (int) x->ne[1], r = (int) a->ne[1];
    const dim3 grid((r + BANK_SHRINK_WARPS - 1) / BANK_SHRINK_WARPS, n_tok);
    dream_bank_shrink_f32<<<grid, BANK_SHRINK_WARPS * WARP_SIZE, 0, ctx.stream()>>>(
        (const float *) x->data, (const float *) a->data, (const int32_t *) ids->data, (float *) dst->data, n_in, r);
    CUDA_CHECK(cudaGetLastError());
}

static void dream_bank_expand(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * y = dst->src[0], * u = dst->src[1], * b = dst->src[2], * ids = dst->src[3];
    const int n_out = (int) y->ne[0], n_tok = (int) y->ne[1], r = (int) u->ne[0];
    const int threads = 256;
    const dim3 grid((n_out + threads - 1) / threads, n_tok);
    dream_bank_expand_f32<<<grid, threads, r * sizeof(float), ctx.stream()>>>(
        (const float *) y->data, (const float *) u->data, (const float *) b->data, (const int32_t *) ids->data,
        (float *) dst->data, r, n_out);
    CUDA_CHECK(cudaGetLastError());
}

bool dream_cuda_custom_supports(const ggml_tensor * op) {
    switch (dream_custom_kind(op)) {
        case DREAM_CUSTOM_SWIGLU_BACK:
            return dream_swiglu_back_layout(op);
        case DREAM_CUSTOM_BANK_SHRINK:
            return dream_bank_shrink_layout(op);
        case DREAM_CUSTOM_BANK_EXPAND:
            return dream_bank_expand_layout(op);
        default:
            return false;
    }
}

bool dream_cuda_custom_op(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!dream_cuda_custom_supports(dst)) {
        return false;
    }
    switch (dream_custom_kind(dst)) {
        case DREAM_CUSTOM_BANK_SHRINK:
            dream_bank_shrink(ctx, dst);
            return true;
        case DREAM_CUSTOM_BANK_EXPAND:
            dream_bank_expand(ctx, dst);
            return true;
        default:
            break;
    }
    // DREAM_CUSTOM_SWIGLU_BACK
    const int64_t n = ggml_nelements(dst->src[1]);
    const float * dy = (const float *) dst->src[0]->data, * g = (const float *) dst->src[1]->data,
                * u = (const float *) dst->src[2]->data;
    float * dg = (float *) dst->data, * du = dg + n;
    cudaStream_t stream = ctx.stream();
    const int threads = 256;
    const bool aligned = n % 4 == 0 && ((uintptr_t) dy | (uintptr_t) g | (uintptr_t) u | (uintptr_t) dg | (uintptr_t) du) % 16 == 0;
    const int64_t work = aligned ? n / 4 : n;
    const int blocks = (int) std::min<int64_t>((work + threads - 1) / threads, 4 * 1024);
    if (aligned) {
        dream_swiglu_back_f32x4<<<blocks, threads, 0, stream>>>((const float4 *) dy, (const float4 *) g, (const float4 *) u,
                                                               (float4 *) dg, (float4 *) du, work);
    } else {
        dream_swiglu_back_f32<<<blocks, threads, 0, stream>>>(dy, g, u, dg, du, n);
    }
    CUDA_CHECK(cudaGetLastError());
    return true;
}
