// What the training step's big products would gain from F16 operands.
//
// A training step's products through the frozen weights (forward W x, backward
// W^T dy) run today as cuBLAS SGEMM in TF32 on a weight expanded to F32. F16
// keeps the same 10-bit mantissa as TF32, so F16 operands with F32 accumulation
// round the same way; what differs is range (F16 stops at 65504 and loses
// precision below 6e-5), which a power-of-two scale per operand takes care of.
// This program times, at the Llama-3.2-1B shapes of a 2048-token step:
//   tf32  cublasSgemm, TF32 tensor ops, weight already F32;
//   f16   cublasGemmEx F16 x F16 -> F32, F32 compute, operands already F16;
//   f16+  the same plus converting the F32 activation (amax pass, then a
//         scaled conversion), as a training graph would have to;
// and the relative L2 of tf32 and f16+ against the F32 product (FP32 math).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 bench/gpu/gemm_math_bench.cu -lcublas -o /tmp/gemm_math_bench
#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::printf("CUDA %s line %d\n", cudaGetErrorString(e_), __LINE__); std::exit(2); } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { std::printf("cuBLAS %d line %d\n", (int) s_, __LINE__); std::exit(2); } } while (0)

__global__ void absmax_kernel(const float * x, size_t n, unsigned int * out) {
    float m = 0.f;
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        m = fmaxf(m, fabsf(x[i]));
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if ((threadIdx.x & 31) == 0) atomicMax(out, __float_as_uint(m));   // nonnegative floats order as their bits
}

// scale = 2^(14 - ceil(log2(amax))): the largest element lands in [2^13, 2^14]
__global__ void to_f16_scaled(const float * x, size_t n, const unsigned int * amax, __half * y) {
    const float a = __uint_as_float(*amax);
    const float s = a > 0.f ? exp2f(14.f - ceilf(log2f(a))) : 1.f;
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        y[i] = __float2half_rn(x[i] * s);
    }
}

__global__ void to_f16(const float * x, size_t n, __half * y) {
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        y[i] = __float2half_rn(x[i]);
    }
}

static double rel_l2(const std::vector<float> & a, const std::vector<float> & ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double) (a[i] - ref[i]) * (a[i] - ref[i]);
        den += (double) ref[i] * ref[i];
    }
    return std::sqrt(num / den);
}

int main() {
    struct shape { int M, K; const char * name; };
    const shape shapes[] = { { 2048, 2048, "q/o" }, { 512, 2048, "k/v" }, { 8192, 2048, "gate/up" },
                             { 2048, 8192, "down" }, { 49152, 2048, "head" } };
    const int N = 2048;
    cublasHandle_t h;
    CB(cublasCreate(&h));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    double sum_tf32 = 0, sum_f16 = 0, sum_f16c = 0;
    std::printf("%-8s %6s %6s %6s | %9s %9s %9s | %9s %9s\n", "weight", "M", "K", "N", "tf32 ms", "f16 ms", "f16+ ms",
                "tf32 err", "f16+ err");
    for (const shape & s : shapes) {
        const size_t nw = (size_t) s.M * s.K, nx = (size_t) s.K * N, ny = (size_t) s.M * N;
        std::vector<float> w(nw), x(nx);
        for (auto & v : w) v = nd(rng) * 0.02f;
        for (auto & v : x) v = nd(rng) * 1e-6f;          // a gradient's magnitude: F16 would flush it unscaled
        float *dw, *dx, *dy;
        __half *hw, *hx;
        unsigned int * amax;
        CK(cudaMalloc(&dw, nw * 4)); CK(cudaMalloc(&dx, nx * 4)); CK(cudaMalloc(&dy, ny * 4));
        CK(cudaMalloc(&hw, nw * 2)); CK(cudaMalloc(&hx, nx * 2)); CK(cudaMalloc(&amax, 4));
        CK(cudaMemcpy(dw, w.data(), nw * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx, x.data(), nx * 4, cudaMemcpyHostToDevice));
        to_f16<<<1024, 256>>>(dw, nw, hw);
        const float one = 1.f, zero = 0.f;
        // y[M, N] = W^T x with W stored K-contiguous per output row (ggml's layout)
        auto sgemm = [&] { CB(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, s.M, N, s.K, &one, dw, s.K, dx, s.K, &zero, dy, s.M)); };
        auto convert = [&] {
            CK(cudaMemsetAsync(amax, 0, 4));
            absmax_kernel<<<1024, 256>>>(dx, nx, amax);
            to_f16_scaled<<<1024, 256>>>(dx, nx, amax, hx);
        };
        auto hgemm = [&] {
            CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.M, N, s.K, &one, hw, CUDA_R_16F, s.K, hx, CUDA_R_16F, s.K,
                            &zero, dy, CUDA_R_32F, s.M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        };
        auto timed = [&](auto && fn) {
            for (int i = 0; i < 3; ++i) fn();
            CK(cudaEventRecord(e0));
            const int reps = 20;
            for (int i = 0; i < reps; ++i) fn();
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            return ms / reps;
        };
        // reference in FP32 math, then TF32 and scaled F16
        std::vector<float> ref(ny), got(ny);
        CB(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
        sgemm();
        CK(cudaMemcpy(ref.data(), dy, ny * 4, cudaMemcpyDeviceToHost));
        CB(cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH));
        const float t_tf32 = timed(sgemm);
        CK(cudaMemcpy(got.data(), dy, ny * 4, cudaMemcpyDeviceToHost));
        const double e_tf32 = rel_l2(got, ref);
        convert();
        const float t_f16 = timed(hgemm);
        const float t_f16c = timed([&] { convert(); hgemm(); });
        CK(cudaMemcpy(got.data(), dy, ny * 4, cudaMemcpyDeviceToHost));
        unsigned int a_bits;
        CK(cudaMemcpy(&a_bits, amax, 4, cudaMemcpyDeviceToHost));
        float a; std::memcpy(&a, &a_bits, 4);
        const float sc = std::exp2(14.f - std::ceil(std::log2(a)));
        for (auto & v : got) v /= sc;
        const double e_f16 = rel_l2(got, ref);
        std::printf("%-8s %6d %6d %6d | %9.3f %9.3f %9.3f | %9.2e %9.2e\n", s.name, s.M, s.K, N, t_tf32, t_f16, t_f16c,
                    e_tf32, e_f16);
        sum_tf32 += t_tf32; sum_f16 += t_f16; sum_f16c += t_f16c;
        cudaFree(dw); cudaFree(dx); cudaFree(dy); cudaFree(hw); cudaFree(hx); cudaFree(amax);
    }
    std::printf("sum      tf32 %.3f ms, f16 %.3f ms, f16 with conversion %.3f ms\n", sum_tf32, sum_f16, sum_f16c);
    return 0;
}
