// A training graph's products through a frozen quantized weight with F16
// operands: the forward y = W^T x (MUL_MAT) and the backward dx = W dy
// (OUT_PROD of W and dy^T).
//
// Both ran as cuBLAS SGEMM in TF32 on the weight expanded to F32
// (mul-mat-exact.cu, out-prod-dequant.cu). TF32 rounds each operand to a
// 10-bit mantissa; F16 has the same 10-bit mantissa, and with F32 accumulation
// the products round the same way at twice the tensor-core rate and half the
// operand bytes (bench/gpu/gemm_math_bench.cu, H200, a 2048-token step's
// shapes: 0.82 ms against 1.45 ms, the same 2.9e-4 from FP32). What F16 lacks
// is range: it stops at 65504 and goes subnormal below 6.1e-5, and a gradient
// sits far below that. So the F32 operand (the activation forward, the
// gradient backward) is scaled by a power of two chosen from its absolute
// maximum (the largest element lands in [2^13, 2^14]), converted, and the
// product is scaled back through cuBLAS's alpha, read on the device; a power
// of two changes no mantissa bit. The weight is expanded straight to F16 by
// ggml-cuda's own converter: a quantized block is an F16 scale times small
// integers, within F16's range for any weight a model stores in F16 or below.
//
// Not used in the FP32 mode (NVIDIA_TF32_OVERRIDE=0), where these products stay
// F32 end to end, nor with DREAMSTAGE_F16_PRODUCTS=0 (dream_cuda_f16_products_set
// overrides it, so a process can compare both). Shapes other than one matrix (ne2 = ne3 = 1) with
// a contiguous src1 (MUL_MAT) or a transposed or contiguous one (OUT_PROD) take
// the F32 path as before.

#include "common.cuh"
#include "convert.cuh"
#include "out-prod.cuh"

#include "../dream-switches.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

// -1: the registry decides; then 0 or 1, set by dream_cuda_f16_products_set (bench/gpu/dream_op_check
// computes the same product both ways in one process)
static int dream_f16_products_forced = -1;

extern "C" void dream_cuda_f16_products_set(int on) {
    dream_f16_products_forced = on < 0 ? -1 : on ? 1 : 0;
}

static bool dream_f16_products_on() {
    const dream_switches & s = dream_switches_loaded();
    if (dream_f16_products_forced >= 0 ? dream_f16_products_forced == 0 : !s.f16_products) {
        return false;
    }
    return !s.fp32_mode;
}

// the operand's absolute maximum, as the bits of a nonnegative float (ordered like the floats)
static __global__ void dream_absmax_f32(const float * __restrict__ x, int64_t n, unsigned int * amax_bits) {
    float m = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        m = fmaxf(m, fabsf(x[i]));
    }
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(amax_bits, __float_as_uint(m));
    }
}

// x * 2^e in F16, e chosen from the absolute maximum; block 0 writes 2^-e (the product's alpha)
static __global__ void dream_to_f16_scaled(const float * __restrict__ x, int64_t n, const unsigned int * amax_bits,
                                           half * __restrict__ y, float * alpha) {
    const float a = __uint_as_float(*amax_bits);
    // a zero or non-finite maximum: no scale (an inf or a NaN then reaches the product as it would in F32)
    const float e = (a > 0.0f && isfinite(a)) ? fminf(fmaxf(14.0f - ceilf(log2f(a)), -126.0f), 126.0f) : 0.0f;
    const float s = exp2f(e);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *alpha = exp2f(-e);
    }
    for (int64_t i = blockIdx.x * (int64_t) blockDim.x + threadIdx.x; i < n; i += (int64_t) gridDim.x * blockDim.x) {
        y[i] = __float2half_rn(x[i] * s);
    }
}

// C (m x n, col-major, F32) = op(W16) op(B16) x alpha, where B was scaled by 1/alpha.
// The weight W is a col-major k x m matrix (ggml's [K, M]) for the forward
// (opA = T), a col-major m x k one for the backward (opA = N).
static void dream_gemm_f16(ggml_backend_cuda_context & ctx, const ggml_tensor * w, cublasOperation_t op_a, int m,
                           const float * b, int64_t nb_elems, cublasOperation_t op_b, int ldb, int n, int k, float * c) {
    cudaStream_t stream = ctx.stream();
    const int64_t nw = ggml_nelements(w);
    ggml_cuda_pool_alloc<half> w16(ctx.pool(), nw);
    ggml_cuda_pool_alloc<half> b16(ctx.pool(), nb_elems);
    ggml_cuda_pool_alloc<float> scalars(ctx.pool(), 4);   // [absmax bits, alpha, beta = 0, pad]
    CUDA_CHECK(cudaMemsetAsync(scalars.get(), 0, 4 * sizeof(float), stream));
    ggml_get_to_fp16_cuda(w->type)(w->data, w16.get(), nw, stream);
    CUDA_CHECK(cudaGetLastError());
    const int threads = 256;
    const int blocks = (int) std::min<int64_t>((nb_elems + threads - 1) / threads, 1024);
    dream_absmax_f32<<<blocks, threads, 0, stream>>>(b, nb_elems, (unsigned int *) scalars.get());
    dream_to_f16_scaled<<<blocks, threads, 0, stream>>>(b, nb_elems, (const unsigned int *) scalars.get(), b16.get(),
                                                        scalars.get() + 1);
    CUDA_CHECK(cudaGetLastError());
    cublasHandle_t h = ctx.cublas_handle();
    CUBLAS_CHECK(cublasSetStream(h, stream));
    CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE));
    const int lda = op_a == CUBLAS_OP_T ? k : m;
    CUBLAS_CHECK(cublasGemmEx(h, op_a, op_b, m, n, k, scalars.get() + 1, w16.get(), CUDA_R_16F, lda, b16.get(),
                              CUDA_R_16F, ldb, scalars.get() + 2, c, CUDA_R_32F, m, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT_TENSOR_OP));
    CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
}

static bool dream_f16_weight_ok(const ggml_tensor * w) {
    return ggml_is_quantized(w->type) && ggml_is_contiguous(w) && ggml_get_to_fp16_cuda(w->type) != nullptr &&
           w->ne[2] == 1 && w->ne[3] == 1;
}

bool dream_cuda_mul_mat_f16(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                            ggml_tensor * dst) {
    // only a whole annotated training product (dream-fit.cpp sets the annotation)
    if (dst->op != GGML_OP_MUL_MAT || dst->src[0] != src0 || dst->src[1] != src1 ||
        ggml_get_op_params_i32(dst, 3) != GGML_PREC_F32 || !dream_f16_weight_ok(src0) ||
        src1->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32 || !ggml_is_contiguous(src1) ||
        !ggml_is_contiguous(dst) || src1->ne[2] != 1 || src1->ne[3] != 1 || !dream_f16_products_on()) {
        return false;
    }
    // dst [M, N] = W^T x: W col-major K x M, x col-major K x N
    const int K = (int) src0->ne[0], M = (int) src0->ne[1], N = (int) src1->ne[1];
    dream_gemm_f16(ctx, src0, CUBLAS_OP_T, M, (const float *) src1->data, ggml_nelements(src1), CUBLAS_OP_N, K, N, K,
                   (float *) dst->data);
    return true;
}

bool dream_cuda_out_prod_f16(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * g = dst->src[1];
    if (!dream_f16_weight_ok(w) || g->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32 || g->ne[2] != 1 ||
        g->ne[3] != 1 || !ggml_is_contiguous(dst) || !dream_f16_products_on()) {
        return false;
    }
    // dst [K, N], dst[k, n] = sum_m W[k, m] g[n, m]; g is [N, M]
    const int K = (int) w->ne[0], M = (int) w->ne[1], N = (int) g->ne[0];
    if (g->ne[1] != M) {
        return false;
    }
    if (g->nb[1] == sizeof(float) && g->nb[0] == (size_t) M * sizeof(float)) {
        // a transposed view of a contiguous [M, N] gradient: col-major M x N as it lies
        dream_gemm_f16(ctx, w, CUBLAS_OP_N, K, (const float *) g->data, (int64_t) M * N, CUBLAS_OP_N, M, N, M,
                       (float *) dst->data);
        return true;
    }
    if (ggml_is_contiguous(g)) {
        // contiguous [N, M]: col-major N x M, used transposed
        dream_gemm_f16(ctx, w, CUBLAS_OP_N, K, (const float *) g->data, (int64_t) M * N, CUBLAS_OP_T, N, N, M,
                       (float *) dst->data);
        return true;
    }
    return false;
}
