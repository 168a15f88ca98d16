// dreamstage: CROSS_ENTROPY_LOSS and CROSS_ENTROPY_LOSS_BACK on CUDA, a block
// per row.
//
// ggml-cuda runs both ops with one warp per row and the row staged in shared
// memory; a row of a 49,152-token vocabulary is 192 KiB, so each SM holds one
// row and one warp at a time. On the H200 a 2048-token step spent 2.0 ms in the
// loss and 2.4 ms in its backward (bench/results/dream_gpu_profile_h200_*.txt),
// where reading the logits and labels once takes about 0.2 ms. Here a block
// of 256 threads covers a row with 16-byte loads:
//
//   loss:      one pass keeps, per thread, the running max m and sum s of
//              exp(x - m) (merged by the rule for partial softmax sums), the
//              sum of labels * logits and the sum of labels; per row
//              loss = (m + log s) * sum(l) - sum(l x), divided by the number
//              of rows, as upstream's kernel defines it;
//   backward:  the same pass for m and s, then dst = (exp(x - m) / s - l) * g / rows.
//
// The per-row losses are added by ggml-cuda's own sum (sum_f32_cuda), as
// upstream adds its per-row terms. The arithmetic is upstream's (expf, logf,
// F32); only the order of the sums differs. DREAMSTAGE_CE_KERNEL=0 (read per
// call, so one process can compare both) leaves both ops to ggml-cuda.
#ifndef DREAM_CE_NO_GGML
#include "common.cuh"
#include "cross-entropy-loss.cuh"
#include "sum.cuh"
#endif

#include "../dream-switches.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int CE_THREADS = 256;

// a partial softmax normalizer: sum over some x of exp(x - m), m their max
struct ce_part {
    float m, s;
};

__device__ __forceinline__ ce_part ce_merge(ce_part a, ce_part b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) {
        return { m, 0.0f };
    }
    return { m, a.s * expf(a.m - m) + b.s * expf(b.m - m) };
}

__device__ __forceinline__ void ce_add(ce_part & p, float x) {
    if (x > p.m) {
        p.s = p.s * expf(p.m - x) + 1.0f;   // exp(-inf) = 0 on the first element
        p.m = x;
    } else {
        p.s += expf(x - p.m);
    }
}

// the block's reduction of a part and two sums; every thread gets the result
__device__ __forceinline__ void ce_reduce(ce_part & p, float & a, float & b) {
    __shared__ float sm[CE_THREADS / 32], ss[CE_THREADS / 32], sa[CE_THREADS / 32], sb[CE_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) {
        const ce_part q = { __shfl_xor_sync(0xffffffff, p.m, o), __shfl_xor_sync(0xffffffff, p.s, o) };
        p = ce_merge(p, q);
        a += __shfl_xor_sync(0xffffffff, a, o);
        b += __shfl_xor_sync(0xffffffff, b, o);
    }
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        sm[w] = p.m; ss[w] = p.s; sa[w] = a; sb[w] = b;
    }
    __syncthreads();
    p = { sm[0], ss[0] };
    a = sa[0];
    b = sb[0];
    for (int i = 1; i < CE_THREADS / 32; ++i) {
        p = ce_merge(p, { sm[i], ss[i] });
        a += sa[i];
        b += sb[i];
    }
}

// per row: the row's loss / n_rows into out[row]
template <bool VEC> __global__ void __launch_bounds__(CE_THREADS) dream_ce_loss_rows(
        const float * __restrict__ logits, const float * __restrict__ labels, float * __restrict__ out, int64_t n_cols,
        int64_t n_rows) {
    const float * x = logits + blockIdx.x * n_cols;
    const float * l = labels + blockIdx.x * n_cols;
    ce_part p = { -INFINITY, 0.0f };
    float lx = 0.0f, ls = 0.0f;
    if (VEC) {
        for (int64_t i = threadIdx.x; i < n_cols / 4; i += CE_THREADS) {
            const float4 xv = __ldg((const float4 *) x + i), lv = __ldg((const float4 *) l + i);
            ce_add(p, xv.x); ce_add(p, xv.y); ce_add(p, xv.z); ce_add(p, xv.w);
            lx += lv.x * xv.x + lv.y * xv.y + lv.z * xv.z + lv.w * xv.w;
            ls += lv.x + lv.y + lv.z + lv.w;
        }
    } else {
        for (int64_t i = threadIdx.x; i < n_cols; i += CE_THREADS) {
            ce_add(p, x[i]);
            lx += l[i] * x[i];
            ls += l[i];
        }
    }
    ce_reduce(p, lx, ls);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = ((p.m + logf(p.s)) * ls - lx) / (float) n_rows;
    }
}

// dst = (softmax(x) - l) * (*grad) / n_rows, per row
template <bool VEC> __global__ void __launch_bounds__(CE_THREADS) dream_ce_back_rows(
        const float * __restrict__ grad, const float * __restrict__ logits, const float * __restrict__ labels,
        float * __restrict__ dst, int64_t n_cols, int64_t n_rows) {
    const float * x = logits + blockIdx.x * n_cols;
    const float * l = labels + blockIdx.x * n_cols;
    float * d = dst + blockIdx.x * n_cols;
    ce_part p = { -INFINITY, 0.0f };
    float unused_a = 0.0f, unused_b = 0.0f;
    if (VEC) {
        for (int64_t i = threadIdx.x; i < n_cols / 4; i += CE_THREADS) {
            const float4 xv = __ldg((const float4 *) x + i);
            ce_add(p, xv.x); ce_add(p, xv.y); ce_add(p, xv.z); ce_add(p, xv.w);
        }
    } else {
        for (int64_t i = threadIdx.x; i < n_cols; i += CE_THREADS) {
            ce_add(p, x[i]);
        }
    }
    ce_reduce(p, unused_a, unused_b);
    const float inv = 1.0f / p.s, g = *grad / (float) n_rows;
    if (VEC) {
        for (int64_t i = threadIdx.x; i < n_cols / 4; i += CE_THREADS) {
            const float4 xv = __ldg((const float4 *) x + i), lv = __ldg((const float4 *) l + i);
            ((float4 *) d)[i] = make_float4((expf(xv.x - p.m) * inv - lv.x) * g, (expf(xv.y - p.m) * inv - lv.y) * g,
                                            (expf(xv.z - p.m) * inv - lv.z) * g, (expf(xv.w - p.m) * inv - lv.w) * g);
        }
    } else {
        for (int64_t i = threadIdx.x; i < n_cols; i += CE_THREADS) {
            d[i] = (expf(x[i] - p.m) * inv - l[i]) * g;
        }
    }
}

bool aligned16(const void * p) {
    return ((uintptr_t) p) % 16 == 0;
}

}  // namespace

// The kernels on plain pointers (row-major [n_rows, n_cols] F32); the per-row
// losses go to rows_out (n_rows floats), for the caller to add.
void dream_cuda_ce_loss_rows(const float * logits, const float * labels, float * rows_out, int64_t n_cols, int64_t n_rows,
                             cudaStream_t stream) {
    if (n_cols % 4 == 0 && aligned16(logits) && aligned16(labels)) {
        dream_ce_loss_rows<true><<<(unsigned) n_rows, CE_THREADS, 0, stream>>>(logits, labels, rows_out, n_cols, n_rows);
    } else {
        dream_ce_loss_rows<false><<<(unsigned) n_rows, CE_THREADS, 0, stream>>>(logits, labels, rows_out, n_cols, n_rows);
    }
}

void dream_cuda_ce_back(const float * grad, const float * logits, const float * labels, float * dst, int64_t n_cols,
                        int64_t n_rows, cudaStream_t stream) {
    if (n_cols % 4 == 0 && aligned16(logits) && aligned16(labels) && aligned16(dst)) {
        dream_ce_back_rows<true><<<(unsigned) n_rows, CE_THREADS, 0, stream>>>(grad, logits, labels, dst, n_cols, n_rows);
    } else {
        dream_ce_back_rows<false><<<(unsigned) n_rows, CE_THREADS, 0, stream>>>(grad, logits, labels, dst, n_cols, n_rows);
    }
}

#ifndef DREAM_CE_NO_GGML
static bool dream_ce_kernel_on() {
    return dream_switches_loaded().ce_kernel;
}

static bool dream_ce_rows_ok(int64_t n_rows) {
    return n_rows > 0 && n_rows <= INT32_MAX;   // a block per row
}

bool dream_cuda_cross_entropy_loss(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * x = dst->src[0], * l = dst->src[1];
    if (!dream_ce_kernel_on() || x->type != GGML_TYPE_F32 || l->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32 ||
        !ggml_is_contiguous(x) || !ggml_is_contiguous(l) || !ggml_are_same_shape(x, l) || !dream_ce_rows_ok(ggml_nrows(x))) {
        return false;
    }
    const int64_t n_rows = ggml_nrows(x);
    ggml_cuda_pool_alloc<float> rows(ctx.pool(), n_rows);
    dream_cuda_ce_loss_rows((const float *) x->data, (const float *) l->data, rows.ptr, x->ne[0], n_rows, ctx.stream());
    CUDA_CHECK(cudaGetLastError());
    sum_f32_cuda(ctx.pool(), rows.ptr, (float *) dst->data, n_rows, ctx.stream());
    return true;
}

bool dream_cuda_cross_entropy_loss_back(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * g = dst->src[0], * x = dst->src[1], * l = dst->src[2];
    if (!dream_ce_kernel_on() || g->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || l->type != GGML_TYPE_F32 ||
        dst->type != GGML_TYPE_F32 || !ggml_is_scalar(g) || !ggml_is_contiguous(x) || !ggml_is_contiguous(l) ||
        !ggml_is_contiguous(dst) || !ggml_are_same_shape(x, l) || !ggml_are_same_shape(x, dst) ||
        !dream_ce_rows_ok(ggml_nrows(x))) {
        return false;
    }
    dream_cuda_ce_back((const float *) g->data, (const float *) x->data, (const float *) l->data, (float *) dst->data,
                       x->ne[0], ggml_nrows(x), ctx.stream());
    CUDA_CHECK(cudaGetLastError());
    return true;
}
#endif
