// The training forward's products through quantized weights, in exact arithmetic.
//
// ggml-cuda multiplies a quantized weight by quantizing the activations to q8_1
// (MMVQ for up to 8 columns, MMQ above). bench/gpu/dream_op_check measured that
// arithmetic against the exact product of the dequantized weight (H200): for
// Q8_0, Q4_0, Q5_0, Q3_K and Q6_K it lands as close as the CPU backend's own
// 8-bit activations do (rel L2 5.3e-3), but for the types with a per-block
// minimum (Q4_1, Q2_K, Q4_K, Q5_K), and for Q4_0/Q5_0 at 8 columns or fewer,
// 1.0e-2 to 1.4e-2; through a whole Q4_K_M model the loss then moved 10x further
// from the exact-weights twin than the CPU's did. This path lands 2.9e-4 (TF32).
//
// ggml has an annotation for "do not convert src1 below F32":
// ggml_prec_set_src(node, GGML_PREC_F32, 1) (op_params[3]). ggml-cuda does not
// honour it for MUL_MAT (MMQ asserts on it), so the hook in ggml_cuda_mul_mat asks
// this function and sends such a product to upstream's cuBLAS path instead, which
// expands the weight with ggml-cuda's own to_fp32 converter into the stream-ordered
// pool and multiplies in F32 when the accumulator precision is F32 as well
// (ggml_prec_set_acc; TF32 tensor ops unless NVIDIA_TF32_OVERRIDE=0, like every
// other F32 product on this backend). dream-fit.cpp sets both on every training
// graph product through a GPU-resident quantized weight; serving's graphs never
// carry them. Outside the FP32 mode an annotated product through a quantized
// weight is taken earlier, by patch 0106's hook (mul-mat-f16.cu: F16 operands,
// the same rounding); this path keeps the shapes that hook leaves.

//
// The FP32 mode (NVIDIA_TF32_OVERRIDE=0) reaches cuBLAS only: ggml-cuda's own
// small-batch kernel (mmf, up to 16 columns) multiplies F32 weights with TF32
// MMA whatever the override, which moved a GPU exact walk in chunks of 16 by
// 6.7e-3 from its one-chunk gradient even in FP32 (docs/architecture/gpu.md,
// "Precision"). So in that mode a training graph's F32 product, which
// dream-fit.cpp annotates the same way, goes to cuBLAS as well.

#include "out-prod.cuh"
#include "convert.cuh"

#include "../dream-switches.h"

#include <cstdlib>
#include <cstring>

static bool dream_fp32_mode() {
    return dream_switches_loaded().fp32_mode;
}

bool dream_cuda_mul_mat_exact(const ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    if (ggml_get_op_params_i32(dst, 3) != GGML_PREC_F32) {
        return false;
    }
    if (src0->type == GGML_TYPE_F32) {
        return dream_fp32_mode();
    }
    return ggml_is_quantized(src0->type) && ggml_is_contiguous(src0) && ggml_get_to_fp32_cuda(src0->type) != nullptr;
}
