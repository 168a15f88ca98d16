// A served LoRA's term for a decode batch in one kernel.
//
// llama.cpp adds an adapter to a weight W as  y = W x + s * B (A x)  (build_lora_mm):
// three nodes beside W's own product, MUL_MAT(A, x) -> t, MUL_MAT(B, t) -> u and
// SCALE(u). When decoding, each of them is a kernel over a few KiB, so an adapter
// on every linear weight of a 16-layer model adds over 300 tiny kernels to each
// token and, measured on the H200 (docs/architecture/gpu.md), took 44% of a 1B
// model's decode speed. Patch 0103 already lets ggml-cuda fold the final ADD
// into W's product; this hook (patch 0104, in ggml_cuda_try_fuse) replaces the
// three LoRA nodes by one kernel when:
//
//   - the batch has at most DREAM_LORA_FUSE_MAX_COLS tokens (decode; prompt
//     batches keep upstream's GEMMs),
//   - A and B are F32 and contiguous, x is F32 with contiguous rows, the rank is
//     4, 8, 16, 32 or 64 (a template each; other ranks keep upstream's nodes),
//   - t and u are used by nothing else (ggml_can_fuse_subgraph): a training
//     graph, whose backward reads t, is never fused.
//
// Each block computes t = A x for its token in full (A is n_in x r floats: 64 KiB
// at 2048 x 8, read from L2 by every block) and then its own slice of the output
// rows, s * B t. The kernel is bound by the latency of its loads, not by
// bandwidth: a first version that computed t one row of A per warp, a chain of
// dependent loads, made decoding slower than the three nodes it replaced (on an
// H200 a rank-8 q,v adapter cost 28% of decode speed against 13%).
// The sums are F32, in another order than upstream's, so the result differs
// from the unfused one by rounding only (bench/gpu/dream_lora_check: within
// 1.5e-7 relative L2 of the same arithmetic in double).
//
// DREAMSTAGE_LORA_FUSION=0 in the environment turns the hook off.

#include "out-prod.cuh"

#include "../dream-switches.h"

#include <cstdlib>

static constexpr int DREAM_LORA_FUSE_MAX_COLS = 8;
static constexpr int DREAM_LORA_THREADS = 256;
static constexpr int DREAM_LORA_ROWS_PER_BLOCK = DREAM_LORA_THREADS;   // a thread per output row
static_assert(DREAM_LORA_THREADS % WARP_SIZE == 0, "whole warps");

// -1: not read yet; then 0 or 1. DREAMSTAGE_LORA_FUSION=0 turns the fusion off;
// dream_cuda_lora_fusion_set() overrides it (bench/gpu/dream_lora_check, which
// computes the same graph both ways in one process). Engine thread only, like
// every graph compute on the context.
static int dream_lora_fusion = -1;

static long long dream_lora_fused_launches = 0;

extern "C" void dream_cuda_lora_fusion_set(int on) {
    dream_lora_fusion = on ? 1 : 0;
}

// Fused chains launched from the host so far (a CUDA graph's replays are not
// counted): lets dream_lora_check and dream_decode_bench see that the fusion ran.
extern "C" long long dream_cuda_lora_fusion_runs() {
    return dream_lora_fused_launches;
}

static bool dream_lora_fusion_enabled() {
    if (dream_lora_fusion < 0) {
        dream_lora_fusion = dream_switches_loaded().lora_fusion ? 1 : 0;
    }
    return dream_lora_fusion != 0;
}

// One block per (slice of DREAM_LORA_ROWS_PER_BLOCK output rows, token).
// Phase 1: t = A x, every thread a strided share of the n_in columns (four at a
// time) for all RANK rows of A at once, then a block reduction.
// Phase 2: out[j] = s * B[j] . t, a thread per row. A: [RANK][n_in] row-major
// (ggml ne0 = n_in), B: [n_out][RANK].
template <int RANK>
static __global__ void dream_lora_decode_kernel(const float * __restrict__ A, const float * __restrict__ B,
                                                const float * __restrict__ x, float * __restrict__ out,
                                                const int n_in, const int n_out,
                                                const int64_t x_stride, const int64_t out_stride, const float s) {
    constexpr int n_warps = DREAM_LORA_THREADS / WARP_SIZE;
    __shared__ float part[n_warps][RANK];
    __shared__ float t[RANK];
    const float * xc = x + blockIdx.y * x_stride;
    const int warp = threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;

    // this thread's row of B, loaded first so that its latency overlaps phase 1
    // (small ranks only: at 32 and 64 the registers are needed for the sums)
    constexpr bool prefetch = RANK <= 16;
    const int j = blockIdx.x * DREAM_LORA_ROWS_PER_BLOCK + threadIdx.x;
    const float4 * brow = (const float4 *) (B + (int64_t) min(j, n_out - 1) * RANK);
    float4 bv[prefetch ? RANK / 4 : 1];
    if (prefetch) {
#pragma unroll
        for (int k = 0; k < RANK / 4; ++k) {
            bv[k] = brow[k];
        }
    }

    float acc[RANK];
#pragma unroll
    for (int k = 0; k < RANK; ++k) {
        acc[k] = 0.0f;
    }
    // float4 columns; unrolled so that several columns' RANK loads are in flight at once
    const int n4 = n_in / 4;
    const float4 * x4 = (const float4 *) xc;
    const float4 * A4 = (const float4 *) A;
#pragma unroll 4
    for (int c = threadIdx.x; c < n4; c += DREAM_LORA_THREADS) {
        const float4 xv = x4[c];
#pragma unroll
        for (int k = 0; k < RANK; ++k) {
            const float4 a = A4[(int64_t) k * n4 + c];
            acc[k] += a.x * xv.x + a.y * xv.y + a.z * xv.z + a.w * xv.w;
        }
    }
#pragma unroll
    for (int k = 0; k < RANK; ++k) {
        acc[k] = warp_reduce_sum(acc[k]);
    }
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < RANK; ++k) {
            part[warp][k] = acc[k];
        }
    }
    __syncthreads();
    if (threadIdx.x < RANK) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < n_warps; ++w) {
            sum += part[w][threadIdx.x];
        }
        t[threadIdx.x] = sum;
    }
    __syncthreads();

    if (j < n_out) {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < RANK / 4; ++k) {
            const float4 v = prefetch ? bv[k] : brow[k];
            sum += v.x * t[4 * k] + v.y * t[4 * k + 1] + v.z * t[4 * k + 2] + v.w * t[4 * k + 3];
        }
        out[blockIdx.y * out_stride + j] = s * sum;
    }
}

static bool dream_lora_rank_supported(int64_t r) {
    return r == 4 || r == 8 || r == 16 || r == 32 || r == 64;
}

static bool dream_f32_2d(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && t->ne[2] == 1 && t->ne[3] == 1 && t->nb[0] == sizeof(float);
}

bool dream_cuda_lora_fusable(const ggml_cgraph * cgraph, int i) {
    if (!dream_lora_fusion_enabled() ||
        !ggml_can_fuse_subgraph(cgraph, i, { GGML_OP_MUL_MAT, GGML_OP_MUL_MAT, GGML_OP_SCALE }, { i + 2 })) {
        return false;
    }
    const ggml_tensor * ax = cgraph->nodes[i];
    const ggml_tensor * bt = cgraph->nodes[i + 1];
    const ggml_tensor * sc = cgraph->nodes[i + 2];
    const ggml_tensor * A = ax->src[0];
    const ggml_tensor * x = ax->src[1];
    const ggml_tensor * B = bt->src[0];
    return bt->src[1] == ax && sc->src[0] == bt &&
           dream_f32_2d(A) && ggml_is_contiguous(A) && dream_f32_2d(B) && ggml_is_contiguous(B) &&
           (uintptr_t) A->data % 16 == 0 && (uintptr_t) B->data % 16 == 0 && A->ne[0] % 4 == 0 &&
           dream_f32_2d(x) && (uintptr_t) x->data % 16 == 0 && x->nb[1] % 16 == 0 &&
           dream_f32_2d(sc) && ggml_is_contiguous(sc) &&
           x->ne[1] >= 1 && x->ne[1] <= DREAM_LORA_FUSE_MAX_COLS &&
           A->ne[0] == x->ne[0] && A->ne[1] == B->ne[0] && dream_lora_rank_supported(A->ne[1]) &&
           sc->ne[0] == B->ne[1] && sc->ne[1] == x->ne[1] &&
           ggml_get_op_params_f32(sc, 1) == 0.0f;   // SCALE's bias
}

void dream_cuda_lora_fused(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * ax = cgraph->nodes[i];
    const ggml_tensor * A = ax->src[0];
    const ggml_tensor * x = ax->src[1];
    const ggml_tensor * B = cgraph->nodes[i + 1]->src[0];
    ggml_tensor * dst = cgraph->nodes[i + 2];
    const int n_in = (int) A->ne[0];
    const int n_out = (int) B->ne[1];
    const dim3 grid((n_out + DREAM_LORA_ROWS_PER_BLOCK - 1) / DREAM_LORA_ROWS_PER_BLOCK, (unsigned) x->ne[1]);
    const float * a = (const float *) A->data;
    const float * b = (const float *) B->data;
    const float * xs = (const float *) x->data;
    float * d = (float *) dst->data;
    const int64_t xst = (int64_t) (x->nb[1] / sizeof(float)), dst_st = (int64_t) (dst->nb[1] / sizeof(float));
    const float s = ggml_get_op_params_f32(dst, 0);
    cudaStream_t st = ctx.stream();
    switch (A->ne[1]) {
        case 4:  dream_lora_decode_kernel<4><<<grid, DREAM_LORA_THREADS, 0, st>>>(a, b, xs, d, n_in, n_out, xst, dst_st, s); break;
        case 8:  dream_lora_decode_kernel<8><<<grid, DREAM_LORA_THREADS, 0, st>>>(a, b, xs, d, n_in, n_out, xst, dst_st, s); break;
        case 16: dream_lora_decode_kernel<16><<<grid, DREAM_LORA_THREADS, 0, st>>>(a, b, xs, d, n_in, n_out, xst, dst_st, s); break;
        case 32: dream_lora_decode_kernel<32><<<grid, DREAM_LORA_THREADS, 0, st>>>(a, b, xs, d, n_in, n_out, xst, dst_st, s); break;
        case 64: dream_lora_decode_kernel<64><<<grid, DREAM_LORA_THREADS, 0, st>>>(a, b, xs, d, n_in, n_out, xst, dst_st, s); break;
        default: GGML_ABORT("dream_cuda_lora_fused: rank %d", (int) A->ne[1]);
    }
    CUDA_CHECK(cudaGetLastError());
    ++dream_lora_fused_launches;
}
