// OUT_PROD on CUDA for a non-F32 src0: the frozen, still-quantized base weight.
//
// LoRA backward through y = W x needs dL/dx = W^T dy, which ggml's MUL_MAT
// backward writes as ggml_out_prod(W, dy^T). Upstream's CUDA OUT_PROD takes only
// an F32 src0, so with a quantized W the scheduler would move the node (and a copy
// of W) to the CPU on every micro-step. The hook in ggml-cuda's out-prod.cu calls
// dream_cuda_out_prod_dequant() for any other src0 type; supports_op asks
// dream_cuda_out_prod_src0_supported().
//
// Outside the FP32 mode the product first goes to mul-mat-f16.cu (F16 operands,
// the same rounding as TF32); what that file does not take comes here.
//
// The method: expand W to F32 in a pooled device buffer with ggml-cuda's own
// to_fp32 converters (exactly the values the CPU backend dequantizes to), then run
// upstream's F32 OUT_PROD (cuBLAS SGEMM, with its broadcasting and transposed-src1
// handling) on a shallow F32 view of that buffer. The buffer lives for one call and
// returns to ggml-cuda's stream-ordered pool; it is not part of the graph
// allocator's plan (see docs/architecture/gpu.md, "Memory").

#include "out-prod.cuh"
#include "convert.cuh"

#include "../dream-switches.h"

#include <cstdlib>
#include <cstring>

// The src0 types this file handles: each has a contiguous to_fp32 converter in
// convert.cu and is covered by tests/native/out_prod_check.cpp. The IQ1/IQ2 types
// and the FP4 formats are left out because they are untested here, not because
// the method would not work for them.
static bool dream_out_prod_type_handled(ggml_type type) {
    switch (type) {
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q2_K:
        case GGML_TYPE_Q3_K:
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K:
        case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_IQ4_XS:
            return true;
        default:
            return false;
    }
}

bool dream_cuda_out_prod_src0_supported(const ggml_tensor * src0) {
    // The converters read k consecutive elements, so src0 must be one contiguous
    // block (a whole weight, or a view of whole rows of one).
    return dream_out_prod_type_handled(src0->type) && ggml_is_contiguous(src0) &&
           ggml_get_to_fp32_cuda(src0->type) != nullptr;
}

// cuBLAS math for the SGEMM. ggml-cuda creates its handles in TF32 tensor-op mode,
// and every other F32 matrix product in a CUDA graph runs that way, so that is the
// default here too. DREAMSTAGE_CUDA_OUT_PROD_MATH=fp32 switches this op to full
// FP32 (about 5x slower on an H200; measured in docs/benchmarks.md), which matches
// the CPU backend to float rounding.
static bool dream_out_prod_full_fp32() {
    return dream_switches_loaded().out_prod_fp32;
}

// mul-mat-f16.cu: the same product with F16 operands; false when it does not apply
bool dream_cuda_out_prod_f16(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

void dream_cuda_out_prod_dequant(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    GGML_ASSERT(dream_cuda_out_prod_src0_supported(src0));
    if (!dream_out_prod_full_fp32() && dream_cuda_out_prod_f16(ctx, dst)) {
        return;
    }

    const int64_t n = ggml_nelements(src0);
    cudaStream_t stream = ctx.stream();

    ggml_cuda_pool_alloc<float> weight_f32(ctx.pool(), n);
    ggml_get_to_fp32_cuda(src0->type)(src0->data, weight_f32.get(), n, stream);
    CUDA_CHECK(cudaGetLastError());

    // A shallow F32 twin of src0 over the expanded buffer, with contiguous strides,
    // and a twin of dst that reads it; upstream's F32 path needs nothing else.
    ggml_tensor src0_f32 = *src0;
    src0_f32.type  = GGML_TYPE_F32;
    src0_f32.data  = weight_f32.get();
    src0_f32.nb[0] = sizeof(float);
    for (int i = 1; i < GGML_MAX_DIMS; ++i) {
        src0_f32.nb[i] = src0_f32.nb[i - 1] * src0_f32.ne[i - 1];
    }
    ggml_tensor dst_f32 = *dst;
    dst_f32.src[0] = &src0_f32;

    const bool full_fp32 = dream_out_prod_full_fp32();
    if (full_fp32) {
        CUBLAS_CHECK(cublasSetMathMode(ctx.cublas_handle(), CUBLAS_DEFAULT_MATH));
    }
    ggml_cuda_out_prod(ctx, &dst_f32);
    if (full_fp32) {
        CUBLAS_CHECK(cublasSetMathMode(ctx.cublas_handle(), CUBLAS_TF32_TENSOR_OP_MATH));
    }
}
