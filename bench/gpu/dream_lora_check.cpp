// A served LoRA's decode term on the GPU, op by op: correctness and time of
// ggml-cuda's fused kernel (patch 0104, dreamstage/ggml_ext/cuda/lora-decode.cu)
// against upstream's three nodes.
//   dream_lora_check
// The graph is what llama.cpp builds for an adapted weight W when decoding
// (build_lora_mm): y = s * B (A x) + W x, with x of 1 to 8 tokens. For each shape
// (n_in x n_out of a 1B model's projections, ranks 8, 16 and 64) it is computed on
// the GPU with the fusion on and off and compared with the same arithmetic in
// double precision on the host (relative L2 over the LoRA term and over y). The
// fused term must land within F32 rounding (1e-5); upstream's nodes run it as TF32
// cuBLAS above 1 to 8 columns (MMVF's limit), so its figure is reported, not bounded.
// Then, for the decode shape of a rank-8 q,v adapter on a 16-layer model (32
// chains in one graph) and of all seven targets (112), the graph's time with the
// fusion on and off, each on a graph of its own (ggml-cuda keys its CUDA graphs by
// the ggml graph, so the two never replay each other's capture); W is F16 there,
// the base products' share of the time is then about a quantized model's.
// Prints one JSON object; exit 1 when a result is off by more than rounding or
// the fusion did not run where it should.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "rel_l2.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

struct chain_shape { int n_in, n_out, rank, n_tok; };

struct built {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_cgraph * gf = nullptr;
    std::vector<ggml_tensor *> A, B, W, x, lora, y;
    ~built() {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
    }
};

// one chain per shape in `chains`, all in one graph, each with its own weights and input
static void build(built & g, ggml_backend_t be, const std::vector<chain_shape> & chains, float s,
                  ggml_type wtype = GGML_TYPE_F32) {
    const size_t n = chains.size();
    ggml_init_params ip = { n * 16 * ggml_tensor_overhead() + ggml_graph_overhead_custom(8 * n + 16, false), nullptr, true };
    g.ctx = ggml_init(ip);
    g.gf = ggml_new_graph_custom(g.ctx, 8 * n + 16, false);
    for (const auto & c : chains) {
        ggml_tensor * A = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, c.n_in, c.rank);
        ggml_tensor * B = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, c.rank, c.n_out);
        ggml_tensor * W = ggml_new_tensor_2d(g.ctx, wtype, c.n_in, c.n_out);
        ggml_tensor * x = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, c.n_in, c.n_tok);
        ggml_tensor * lora = ggml_scale(g.ctx, ggml_mul_mat(g.ctx, B, ggml_mul_mat(g.ctx, A, x)), s);
        ggml_tensor * y = ggml_add(g.ctx, lora, ggml_mul_mat(g.ctx, W, x));
        ggml_set_output(lora);   // read back on its own (the fused chain's output node may be an output)
        ggml_set_output(y);
        ggml_build_forward_expand(g.gf, y);
        g.A.push_back(A); g.B.push_back(B); g.W.push_back(W); g.x.push_back(x); g.lora.push_back(lora); g.y.push_back(y);
    }
    g.buf = ggml_backend_alloc_ctx_tensors(g.ctx, be);
}

static std::vector<float> randn(size_t n, std::mt19937 & rng, float sd) {
    std::normal_distribution<float> N(0.0f, sd);
    std::vector<float> v(n);
    for (auto & e : v) e = N(rng);
    return v;
}

int main() {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (!dev) { std::printf("{\"skipped\": \"no GPU backend\"}\n"); return 0; }
    ggml_backend_t be = ggml_backend_dev_init(dev, nullptr);
    auto fusion_set = (void (*)(int)) dlsym(RTLD_DEFAULT, "dream_cuda_lora_fusion_set");
    auto fusion_runs = (long long (*)()) dlsym(RTLD_DEFAULT, "dream_cuda_lora_fusion_runs");
    if (!fusion_set || !fusion_runs) { std::printf("FAILED: the fusion's switch is not in this build\n"); return 1; }
    const float s = 2.0f;
    std::mt19937 rng(5);
    bool ok = true;
    std::string out = "{\n  \"checks\": [\n";
    const chain_shape shapes[] = {
        { 2048, 2048, 8, 1 }, { 2048, 512, 8, 1 }, { 2048, 8192, 16, 1 }, { 8192, 2048, 8, 1 },
        { 2048, 2048, 64, 1 }, { 2048, 2048, 8, 2 }, { 2048, 512, 16, 8 }, { 8192, 2048, 64, 8 },
    };
    char buf[512];
    for (size_t si = 0; si < std::size(shapes); ++si) {
        const chain_shape c = shapes[si];
        const auto A = randn((size_t) c.n_in * c.rank, rng, 1.0f / std::sqrt((float) c.n_in));
        const auto B = randn((size_t) c.rank * c.n_out, rng, 0.05f);
        const auto W = randn((size_t) c.n_in * c.n_out, rng, 1.0f / std::sqrt((float) c.n_in));
        const auto x = randn((size_t) c.n_in * c.n_tok, rng, 1.0f);
        // reference in double: lora[t][j] = s * sum_k B[j][k] sum_i A[k][i] x[t][i]
        std::vector<double> ref_lora((size_t) c.n_out * c.n_tok), ref_y(ref_lora.size());
        for (int t = 0; t < c.n_tok; ++t) {
            std::vector<double> tk(c.rank, 0.0);
            for (int k = 0; k < c.rank; ++k)
                for (int i = 0; i < c.n_in; ++i) tk[k] += (double) A[(size_t) k * c.n_in + i] * x[(size_t) t * c.n_in + i];
            for (int j = 0; j < c.n_out; ++j) {
                double l = 0, w = 0;
                for (int k = 0; k < c.rank; ++k) l += (double) B[(size_t) j * c.rank + k] * tk[k];
                for (int i = 0; i < c.n_in; ++i) w += (double) W[(size_t) j * c.n_in + i] * x[(size_t) t * c.n_in + i];
                ref_lora[(size_t) t * c.n_out + j] = s * l;
                ref_y[(size_t) t * c.n_out + j] = s * l + w;
            }
        }
        double rel_lora[2], rel_y[2];
        long long fused[2];
        for (int f = 0; f < 2; ++f) {
            fusion_set(f);
            built g;
            build(g, be, { c }, s);
            ggml_backend_tensor_set(g.A[0], A.data(), 0, A.size() * sizeof(float));
            ggml_backend_tensor_set(g.B[0], B.data(), 0, B.size() * sizeof(float));
            ggml_backend_tensor_set(g.W[0], W.data(), 0, W.size() * sizeof(float));
            ggml_backend_tensor_set(g.x[0], x.data(), 0, x.size() * sizeof(float));
            const long long before = fusion_runs();
            ggml_backend_graph_compute(be, g.gf);
            ggml_backend_synchronize(be);
            fused[f] = fusion_runs() - before;
            std::vector<float> y(ref_y.size());
            ggml_backend_tensor_get(g.y[0], y.data(), 0, y.size() * sizeof(float));
            rel_y[f] = rel_l2(y, ref_y);
            std::vector<float> l(ref_lora.size());
            ggml_backend_tensor_get(g.lora[0], l.data(), 0, l.size() * sizeof(float));
            rel_lora[f] = rel_l2(l, ref_lora);
        }
        // the fused term in F32 (upstream's nodes run it as TF32 cuBLAS above MMVF's column
        // count), and y, whose base product is upstream's either way, no worse than unfused
        const bool pass = fused[1] == 1 && fused[0] == 0 && rel_lora[1] < 1e-5 && rel_y[1] <= 1.5 * rel_y[0] + 1e-6;
        ok = ok && pass;
        std::snprintf(buf, sizeof buf,
                      "    {\"n_in\": %d, \"n_out\": %d, \"rank\": %d, \"n_tok\": %d, \"fused_kernels\": %lld, \"unfused_kernels\": %lld, "
                      "\"rel_l2_y\": [%.2e, %.2e], \"rel_l2_lora\": [%.2e, %.2e], \"pass\": %s}%s\n",
                      c.n_in, c.n_out, c.rank, c.n_tok, fused[1], fused[0], rel_y[0], rel_y[1], rel_lora[0], rel_lora[1],
                      pass ? "true" : "false", si + 1 < std::size(shapes) ? "," : "");
        out += buf;
    }
    out += "  ],\n  \"timing\": [\n";
    // decode of a 16-layer 1B model: q (2048 -> 2048) and v (2048 -> 512) per layer, or all
    // seven projections (q, k, v, o, gate, up, down)
    struct set { const char * name; std::vector<chain_shape> per_layer; };
    const set sets[] = {
        { "q,v", { { 2048, 2048, 8, 1 }, { 2048, 512, 8, 1 } } },
        { "all", { { 2048, 2048, 8, 1 }, { 2048, 512, 8, 1 }, { 2048, 512, 8, 1 }, { 2048, 2048, 8, 1 },
                   { 2048, 8192, 8, 1 }, { 2048, 8192, 8, 1 }, { 8192, 2048, 8, 1 } } },
    };
    for (size_t ti = 0; ti < std::size(sets); ++ti) {
        double us[2];
        for (int f = 0; f < 2; ++f) {
            fusion_set(f);
            // one graph holding every chain of 16 layers (W included, as decode runs it)
            std::vector<chain_shape> chains;
            for (int layer = 0; layer < 16; ++layer) chains.insert(chains.end(), sets[ti].per_layer.begin(), sets[ti].per_layer.end());
            built g;
            build(g, be, chains, s, GGML_TYPE_F16);
            for (auto * t : { &g.A, &g.B, &g.W, &g.x }) {
                for (ggml_tensor * e : *t) {
                    const auto v = randn((size_t) ggml_nelements(e), rng, 0.02f);
                    if (e->type == GGML_TYPE_F16) {
                        std::vector<ggml_fp16_t> h(v.size());
                        ggml_fp32_to_fp16_row(v.data(), h.data(), (int64_t) v.size());
                        ggml_backend_tensor_set(e, h.data(), 0, ggml_nbytes(e));
                    } else {
                        ggml_backend_tensor_set(e, v.data(), 0, ggml_nbytes(e));
                    }
                }
            }
            std::vector<double> ms;
            for (int it = 0; it < 60; ++it) {
                const auto t0 = std::chrono::steady_clock::now();
                ggml_backend_graph_compute(be, g.gf);
                ggml_backend_synchronize(be);
                if (it >= 10) ms.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
            }
            std::sort(ms.begin(), ms.end());
            us[f] = ms[ms.size() / 2];
        }
        std::snprintf(buf, sizeof buf, "    {\"targets\": \"%s\", \"rank\": 8, \"layers\": 16, \"w_type\": \"f16\", \"us_per_token_unfused\": %.1f, \"us_per_token_fused\": %.1f}%s\n",
                      sets[ti].name, us[0], us[1], ti + 1 < std::size(sets) ? "," : "");
        out += buf;
    }
    fusion_set(1);
    out += std::string("  ],\n  \"pass\": ") + (ok ? "true" : "false") + "\n}\n";
    std::fputs(out.c_str(), stdout);
    ggml_backend_free(be);
    return ok ? 0 : 1;
}
