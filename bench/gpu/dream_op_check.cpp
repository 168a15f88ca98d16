// How far one quantized matrix product lands from exact arithmetic on the CPU
// and on the GPU, per weight type: W (quantized, n_out x n_in) times X
// (n_in x n_tok, F32, N(0, 1) like normed activations). The reference is the
// product of the dequantized W with X in double precision, so the two backends'
// own roundings (their 8-bit activation formats, their accumulation order) are
// measured against the same exact value. It localizes a model-level gap
// between backends (dream_gpu_check) to the weight types that cause it.
//   dream_op_check [n_in=256] [n_out=768]
// Prints one JSON object per (type, n_tok): rel L2 of CPU and GPU against the
// exact product, of GPU against CPU, and of the GPU's product with src1 and
// the accumulator at F32 (what a training graph runs) against the exact product,
// with F16 operands (cuda/mul-mat-f16.cu, the default) and with
// DREAMSTAGE_F16_PRODUCTS=0 (F32 operands, TF32 cuBLAS; set through dream_cuda_f16_products_set). Then the backward's
// product, OUT_PROD(W, dy^T), with dy ~ 1e-8 N(0, 1) (a gradient's size, far
// below F16's normal range), both ways. Exit 1 when an F16 product lands more
// than 2x the F32 path's distance (+1e-6) from exact.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "rel_l2.h"

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

// exact: the annotations a dreamstage training graph puts on a product through a
// quantized weight (src1 and the accumulator at F32), which the hook in
// ggml-cuda runs as F32 cuBLAS over the dequantized weight
static std::vector<float> run_mul_mat(ggml_backend_t be, ggml_type type, const std::vector<uint8_t> & wq,
                                      const std::vector<float> & x, int n_in, int n_out, int n_tok, bool exact = false) {
    ggml_init_params ip = { 4 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, type, n_in, n_out);
    ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, n_tok);
    ggml_tensor * y = ggml_mul_mat(ctx, w, a);
    if (exact) {
        ggml_prec_set_acc(y, GGML_PREC_F32);
        ggml_prec_set_src(y, GGML_PREC_F32, 1);
    }
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
    ggml_backend_tensor_set(a, x.data(), 0, x.size() * sizeof(float));
    ggml_backend_graph_compute(be, gf);
    std::vector<float> out((size_t) n_out * n_tok);
    ggml_backend_tensor_get(y, out.data(), 0, out.size() * sizeof(float));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return out;
}

// dx = W dy as a training graph's backward writes it: OUT_PROD(W, transpose(dy)), dy [n_out, n_tok]
static std::vector<float> run_out_prod(ggml_backend_t be, ggml_type type, const std::vector<uint8_t> & wq,
                                       const std::vector<float> & dy, int n_in, int n_out, int n_tok) {
    ggml_init_params ip = { 5 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * w = ggml_new_tensor_2d(ctx, type, n_in, n_out);
    ggml_tensor * g = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_out, n_tok);
    ggml_tensor * dx = ggml_out_prod(ctx, w, ggml_transpose(ctx, g));
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, dx);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
    ggml_backend_tensor_set(g, dy.data(), 0, dy.size() * sizeof(float));
    ggml_backend_graph_compute(be, gf);
    std::vector<float> out((size_t) n_in * n_tok);
    ggml_backend_tensor_get(dx, out.data(), 0, out.size() * sizeof(float));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return out;
}

// the GPU's result with the F16 operands (default) and without
template <typename F> static std::pair<std::vector<float>, std::vector<float>> f16_and_f32(F && fn) {
    // ggml-cuda's override of DREAMSTAGE_F16_PRODUCTS (read once, at its first use)
    static const auto f16_set = (void (*)(int)) dlsym(RTLD_DEFAULT, "dream_cuda_f16_products_set");
    if (!f16_set) {
        std::fprintf(stderr, "dream_cuda_f16_products_set not found in ggml-cuda\n");
        std::exit(1);
    }
    std::vector<float> f16 = fn();
    f16_set(0);
    std::vector<float> f32 = fn();
    f16_set(-1);
    return { f16, f32 };
}

int main(int argc, char ** argv) {
    const int n_in = argc > 1 ? std::atoi(argv[1]) : 256, n_out = argc > 2 ? std::atoi(argv[2]) : 768;
    ggml_backend_load_all();
    ggml_backend_dev_t gpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_t gpu = gpu_dev ? ggml_backend_dev_init(gpu_dev, nullptr) : nullptr;
    if (!gpu) std::fprintf(stderr, "no GPU backend: CPU only\n");
    std::mt19937 rng(7);
    std::normal_distribution<float> N(0.0f, 1.0f);
    std::vector<float> wf((size_t) n_in * n_out);
    for (auto & v : wf) v = 0.05f * N(rng);
    const ggml_type types[] = { GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,
                                GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_IQ4_XS, GGML_TYPE_F16 };
    const int toks[] = { 8, 24, 96, 512 };
    bool failed = false;
    for (ggml_type type : types) {
        std::vector<uint8_t> wq(ggml_row_size(type, n_in) * n_out);
        ggml_quantize_chunk(type, wf.data(), wq.data(), 0, n_out, n_in, nullptr);
        std::vector<float> wd((size_t) n_in * n_out);
        ggml_get_type_traits(type)->to_float(wq.data(), wd.data(), (int64_t) n_in * n_out);
        for (int n_tok : toks) {
            std::vector<float> x((size_t) n_in * n_tok);
            for (auto & v : x) v = N(rng);
            std::vector<double> ref((size_t) n_out * n_tok);
            for (int t = 0; t < n_tok; ++t) {
                for (int o = 0; o < n_out; ++o) {
                    double s = 0;
                    for (int i = 0; i < n_in; ++i) s += (double) wd[(size_t) o * n_in + i] * x[(size_t) t * n_in + i];
                    ref[(size_t) t * n_out + o] = s;
                }
            }
            const std::vector<float> yc = run_mul_mat(cpu, type, wq, x, n_in, n_out, n_tok);
            std::printf("{\"type\": \"%s\", \"n_in\": %d, \"n_out\": %d, \"n_tok\": %d, \"cpu_vs_exact\": %.3e",
                        ggml_type_name(type), n_in, n_out, n_tok, rel_l2(yc, ref));
            if (gpu) {
                const std::vector<float> yg = run_mul_mat(gpu, type, wq, x, n_in, n_out, n_tok);
                std::vector<double> ycd(yc.begin(), yc.end());
                std::printf(", \"gpu_vs_exact\": %.3e, \"gpu_vs_cpu\": %.3e", rel_l2(yg, ref), rel_l2(yg, ycd));
                if (ggml_is_quantized(type)) {
                    const auto [ye16, ye32] = f16_and_f32([&] { return run_mul_mat(gpu, type, wq, x, n_in, n_out, n_tok, true); });
                    const double e16 = rel_l2(ye16, ref), e32 = rel_l2(ye32, ref);
                    std::printf(", \"gpu_f32_src1_vs_exact\": %.3e, \"gpu_f32_src1_f32_operands_vs_exact\": %.3e", e16, e32);
                    if (!(e16 <= 2 * e32 + 1e-6)) {
                        failed = true;
                    }
                }
            }
            std::printf("}\n");
        }
        // the backward's product at one size, for the types the benchmarks train on
        if (gpu && (type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K)) {
            const int n_tok = 512;
            std::vector<float> dy((size_t) n_out * n_tok);
            for (auto & v : dy) v = 1e-8f * N(rng);
            std::vector<double> ref((size_t) n_in * n_tok, 0.0);
            for (int t = 0; t < n_tok; ++t) {
                for (int o = 0; o < n_out; ++o) {
                    const double g = dy[(size_t) t * n_out + o];
                    const float * wr = &wd[(size_t) o * n_in];
                    double * r = &ref[(size_t) t * n_in];
                    for (int i = 0; i < n_in; ++i) r[i] += wr[i] * g;
                }
            }
            const auto [d16, d32] = f16_and_f32([&] { return run_out_prod(gpu, type, wq, dy, n_in, n_out, n_tok); });
            const double e16 = rel_l2(d16, ref), e32 = rel_l2(d32, ref);
            std::printf("{\"type\": \"%s\", \"op\": \"out_prod\", \"n_in\": %d, \"n_out\": %d, \"n_tok\": %d, "
                        "\"gpu_f16_operands_vs_exact\": %.3e, \"gpu_f32_operands_vs_exact\": %.3e}\n",
                        ggml_type_name(type), n_in, n_out, n_tok, e16, e32);
            if (!(e16 <= 2 * e32 + 1e-6)) {
                failed = true;
            }
        }
    }
    if (gpu) ggml_backend_free(gpu);
    ggml_backend_free(cpu);
    if (failed) {
        std::printf("FAILED: an F16-operand product landed more than 2x the F32 path's distance from exact\n");
    }
    return failed ? 1 : 0;
}
