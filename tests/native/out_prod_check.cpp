// OUT_PROD with a quantized src0, checked through the public ggml backend API.
//
// With a GPU backend present (a -DGGML_CUDA=ON build) every case runs the op on
// the GPU and compares it with the CPU backend's OUT_PROD on the same weights
// expanded to F32 on the host; it also checks that the GPU claims the op
// (supports_op) and that a scheduler with a GPU-resident weight keeps the node on
// the GPU. Without a GPU it checks the CPU backend's own quantized OUT_PROD
// against that F32 reference, which keeps the reference honest in CI.
//
//   out_prod_check [--quick] [--timing-only] [--bench ROUNDS] [--json PATH]
//
// --quick drops the 2048 x 8192 x 512 cases; --timing-only keeps only those and
// skips the CPU references (for repeated benchmark processes). --bench times, on the GPU, the
// quantized op against upstream's F32 op on pre-expanded weights, in A B B A
// order per round. DREAMSTAGE_CUDA_OUT_PROD_MATH=fp32 selects full FP32 cuBLAS
// math for the quantized op (default: TF32, like every F32 GEMM in ggml-cuda).
// Exit status 1 on any failed check.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct OutProdCase {
    std::string name;
    ggml_type   type;
    int64_t     n_in, n_out, tokens;   // W is [n_in, n_out]; dst is [n_in, tokens]
    int64_t     w2, w3;                // src0 batch dims (broadcast over src1's)
    int64_t     b2, b3;                // src1 / dst batch dims
    bool        src1_transposed;       // ggml_transpose(dy), as MUL_MAT backward builds it
    bool        realistic;
};

struct Weights {
    std::vector<uint8_t> packed;    // src0 in its own type
    std::vector<float>   expanded;  // the same values as F32 (host to_float)
};

int g_failures = 0;

void check(bool ok, const std::string & what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    std::fflush(stdout);
    if (!ok) {
        g_failures++;
    }
}

double rel_l2(const std::vector<float> & got, const std::vector<float> & want) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double d = (double) got[i] - (double) want[i];
        num += d * d;
        den += (double) want[i] * (double) want[i];
    }
    return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

Weights make_weights(const OutProdCase & c, std::mt19937 & rng) {
    const int64_t n_rows = c.n_out * c.w2 * c.w3;
    std::vector<float> w(c.n_in * n_rows);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float & x : w) {
        x = u(rng);
    }
    Weights out;
    out.packed.resize(ggml_row_size(c.type, c.n_in) * n_rows);
    // Row ranges in parallel: quantizing a 2048 x 8192 K-quant weight on one core
    // takes seconds, and the benchmark starts several processes.
    const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), n_rows));
    const int64_t rows_per_thread = (n_rows + n_threads - 1) / n_threads;
    std::vector<std::thread> workers;
    for (int64_t r0 = 0; r0 < n_rows; r0 += rows_per_thread) {
        const int64_t nr = std::min(rows_per_thread, n_rows - r0);
        workers.emplace_back([&, r0, nr] {
            ggml_quantize_chunk(c.type, w.data(), out.packed.data(), r0 * c.n_in, nr, c.n_in, nullptr);
        });
    }
    for (std::thread & t : workers) {
        t.join();
    }
    out.expanded.resize(w.size());
    ggml_get_type_traits(c.type)->to_float(out.packed.data(), out.expanded.data(), (int64_t) w.size());
    return out;
}

// One OUT_PROD graph on one backend, with its own context and buffer.
struct OutProdGraph {
    ggml_context *          ctx    = nullptr;
    ggml_backend_buffer_t   buffer = nullptr;
    ggml_cgraph *           graph  = nullptr;
    ggml_tensor *           w      = nullptr;
    ggml_tensor *           dy     = nullptr;
    ggml_tensor *           out    = nullptr;

    OutProdGraph(const OutProdCase & c, ggml_type w_type) {
        ggml_init_params params = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true };
        ctx = ggml_init(params);
        w = ggml_new_tensor_4d(ctx, w_type, c.n_in, c.n_out, c.w2, c.w3);
        ggml_tensor * src1;
        if (c.src1_transposed) {
            dy   = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.n_out, c.tokens, c.b2, c.b3);
            src1 = ggml_transpose(ctx, dy);
        } else {
            dy   = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.tokens, c.n_out, c.b2, c.b3);
            src1 = dy;
        }
        out   = ggml_out_prod(ctx, w, src1);
        graph = ggml_new_graph(ctx);
        ggml_build_forward_expand(graph, out);
    }
    OutProdGraph(const OutProdGraph &) = delete;
    OutProdGraph & operator=(const OutProdGraph &) = delete;

    void place(ggml_backend_t backend, const void * w_data, const std::vector<float> & dy_data) {
        buffer = ggml_backend_alloc_ctx_tensors(ctx, backend);
        GGML_ASSERT(buffer != nullptr);
        ggml_backend_tensor_set(w, w_data, 0, ggml_nbytes(w));
        ggml_backend_tensor_set(dy, dy_data.data(), 0, ggml_nbytes(dy));
    }

    std::vector<float> compute(ggml_backend_t backend) {
        GGML_ASSERT(ggml_backend_graph_compute(backend, graph) == GGML_STATUS_SUCCESS);
        std::vector<float> result(ggml_nelements(out));
        ggml_backend_tensor_get(out, result.data(), 0, ggml_nbytes(out));
        return result;
    }

    // Mean wall time of one synchronous graph_compute, over `iters` calls.
    double ms_per_call(ggml_backend_t backend, int iters) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
            GGML_ASSERT(ggml_backend_graph_compute(backend, graph) == GGML_STATUS_SUCCESS);
        }
        ggml_backend_synchronize(backend);
        const auto t1 = std::chrono::steady_clock::now();
        return std::chrono::duration<double, std::milli>(t1 - t0).count() / iters;
    }

    ~OutProdGraph() {
        if (buffer) {
            ggml_backend_buffer_free(buffer);
        }
        ggml_free(ctx);
    }
};

std::vector<OutProdCase> make_cases(bool quick) {
    const ggml_type all_types[] = {
        GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0,
        GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K,
        GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_IQ4_NL, GGML_TYPE_IQ4_XS,
    };
    const ggml_type realistic_types[] = {
        GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_F16,
    };
    std::vector<OutProdCase> cases;
    for (ggml_type t : all_types) {
        const std::string n = ggml_type_name(t);
        // dL/dx of a projection: dy transposed, one sequence
        cases.push_back({n + " 256x384x40 dy^T",        t, 256, 384, 40, 1, 1, 1, 1, true,  false});
        // a materialized dy^T
        cases.push_back({n + " 512x96x33 contiguous",   t, 512, 96,  33, 1, 1, 1, 1, false, false});
        // batch dims equal (one strided batched GEMM)
        cases.push_back({n + " 256x64x24x3 dy^T",       t, 256, 64,  24, 3, 1, 3, 1, true,  false});
        // src0 broadcast over dims 2 and 3 (pointer-batched GEMM; the CPU's quantized path refuses this)
        cases.push_back({n + " 256x128x24 bcast 2x1->4x2", t, 256, 128, 24, 2, 1, 4, 2, false, false});
    }
    if (!quick) {
        for (ggml_type t : realistic_types) {
            cases.push_back({std::string(ggml_type_name(t)) + " 2048x8192x512 dy^T", t, 2048, 8192, 512, 1, 1, 1, 1, true, true});
        }
    }
    return cases;
}

bool use_full_fp32() {
    const char * v = std::getenv("DREAMSTAGE_CUDA_OUT_PROD_MATH");
    return v != nullptr && std::strcmp(v, "fp32") == 0;
}

std::string fmt(const char * f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return buf;
}

struct BenchRow {
    std::string name;
    std::vector<double> quant_ms, f32_ms;
};

}  // namespace

int main(int argc, char ** argv) {
    bool quick = false;
    bool timing_only = false;
    int bench_rounds = 0;
    std::string json_path;
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--quick")) {
            quick = true;
        } else if (!std::strcmp(argv[i], "--timing-only")) {
            timing_only = true;
        } else if (!std::strcmp(argv[i], "--bench") && i + 1 < argc) {
            bench_rounds = std::atoi(argv[++i]);
        } else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
            json_path = argv[++i];
        } else {
            std::fprintf(stderr, "usage: %s [--quick] [--timing-only] [--bench ROUNDS] [--json PATH]\n", argv[0]);
            return 2;
        }
    }

    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    GGML_ASSERT(cpu != nullptr);
    ggml_backend_reg_t cpu_reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(cpu));
    auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_set_n_threads");
    if (set_threads) {
        set_threads(cpu, (int) std::max(1u, std::thread::hardware_concurrency()));
    }
    ggml_backend_t gpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_GPU, nullptr);
    const bool full_fp32 = use_full_fp32();
    std::printf("gpu: %s; quantized OUT_PROD math: %s\n",
                gpu ? ggml_backend_dev_description(ggml_backend_get_device(gpu)) : "none",
                full_fp32 ? "fp32" : "tf32 (ggml-cuda default)");

    // Tolerances, fixed from the arithmetic before any run:
    // - FP32 GEMM against the CPU's FP32 sum differs only in summation order: ~1e-7.
    // - TF32 rounds both inputs to 10 mantissa bits (unit roundoff 2^-11 ~ 4.9e-4),
    //   so a sum of random-sign products lands near 4e-4 relative L2.
    // - The quantized path on the GPU against upstream's F32 path on the host-expanded
    //   weights runs the same GEMM; only the expansion could differ (last-bit FMA
    //   contraction in a few formats).
    const double tol_vs_cpu      = full_fp32 ? 1e-5 : 2e-3;
    const double tol_vs_gpu_f32  = 1e-6;
    const double tol_cpu_q       = 1e-5;

    std::mt19937 rng(1234);
    std::vector<BenchRow> bench;
    std::string json_cases;

    for (const OutProdCase & c : make_cases(quick)) {
        if (timing_only && !c.realistic) {
            continue;
        }
        Weights weights = make_weights(c, rng);
        OutProdGraph shape(c, GGML_TYPE_F32);
        std::vector<float> dy((size_t) ggml_nelements(shape.dy));
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (float & x : dy) {
            x = u(rng);
        }

        // Reference: the CPU backend's F32 OUT_PROD on the host-expanded weights.
        std::vector<float> want;
        if (!timing_only) {
            OutProdGraph cpu_ref(c, GGML_TYPE_F32);
            cpu_ref.place(cpu, weights.expanded.data(), dy);
            want = cpu_ref.compute(cpu);
        }

        std::string json_case = "{\"case\": \"" + c.name + "\"";
        const bool broadcast = c.w2 != c.b2 || c.w3 != c.b3;
        OutProdGraph cpu_q(c, c.type);
        // The CPU backend has no BF16 OUT_PROD and no broadcast for a quantized src0.
        if (!timing_only && !broadcast && ggml_backend_supports_op(cpu, cpu_q.out)) {
            cpu_q.place(cpu, weights.packed.data(), dy);
            const double r = rel_l2(cpu_q.compute(cpu), want);
            check(r < tol_cpu_q, c.name + ": CPU quantized vs CPU F32 rel_l2=" + fmt("%.3e", r));
            json_case += ", \"cpu_q_rel_l2\": " + fmt("%.6e", r);
        }

        if (gpu) {
            OutProdGraph gpu_q(c, c.type);
            gpu_q.place(gpu, weights.packed.data(), dy);
            check(ggml_backend_supports_op(gpu, gpu_q.out), c.name + ": GPU supports_op");
            const std::vector<float> got = gpu_q.compute(gpu);
            if (!timing_only) {
                const double r_cpu = rel_l2(got, want);
                check(r_cpu < tol_vs_cpu, c.name + ": GPU quantized vs CPU F32 rel_l2=" + fmt("%.3e", r_cpu));
                json_case += ", \"gpu_vs_cpu_rel_l2\": " + fmt("%.6e", r_cpu);
            }

            OutProdGraph gpu_f32(c, GGML_TYPE_F32);
            gpu_f32.place(gpu, weights.expanded.data(), dy);
            if (!full_fp32) {
                // Upstream's F32 op always runs in the handle's TF32 mode.
                const double r_gpu = rel_l2(got, gpu_f32.compute(gpu));
                check(r_gpu < tol_vs_gpu_f32, c.name + ": GPU quantized vs GPU F32 on expanded weights rel_l2=" + fmt("%.3e", r_gpu));
                json_case += ", \"gpu_vs_gpu_f32_rel_l2\": " + fmt("%.6e", r_gpu);
            }

            if (bench_rounds > 0 && c.realistic) {
                BenchRow row{c.name, {}, {}};
                gpu_q.ms_per_call(gpu, 3);  // warm-up: pool growth, cuBLAS heuristics, graph capture
                gpu_f32.ms_per_call(gpu, 3);
                const int iters = 20;
                for (int round = 0; round < bench_rounds; ++round) {
                    const double a1 = gpu_q.ms_per_call(gpu, iters);
                    const double b1 = gpu_f32.ms_per_call(gpu, iters);
                    const double b2 = gpu_f32.ms_per_call(gpu, iters);
                    const double a2 = gpu_q.ms_per_call(gpu, iters);
                    row.quant_ms.push_back((a1 + a2) / 2);
                    row.f32_ms.push_back((b1 + b2) / 2);
                }
                bench.push_back(row);
            }
        }
        json_cases += (json_cases.empty() ? "" : ",\n    ") + json_case + "}";
    }

    if (gpu) {
        // A weight resident on the GPU: the scheduler keeps OUT_PROD there instead of
        // copying the weight to the CPU (what upstream's F32-only supports_op caused).
        // Only W and dy are allocated up front, as llama.cpp does with model weights.
        OutProdCase c{"Q4_K sched", GGML_TYPE_Q4_K, 256, 128, 16, 1, 1, 1, 1, true, false};
        Weights weights = make_weights(c, rng);
        ggml_init_params params = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true };
        ggml_context * leaf_ctx = ggml_init(params);
        ggml_tensor * w  = ggml_new_tensor_2d(leaf_ctx, c.type, c.n_in, c.n_out);
        ggml_tensor * dy = ggml_new_tensor_2d(leaf_ctx, GGML_TYPE_F32, c.n_out, c.tokens);
        ggml_backend_buffer_t leaf_buf = ggml_backend_alloc_ctx_tensors(leaf_ctx, gpu);
        ggml_backend_buffer_set_usage(leaf_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_set(w, weights.packed.data(), 0, ggml_nbytes(w));
        ggml_context * op_ctx = ggml_init(params);
        ggml_tensor * out = ggml_out_prod(op_ctx, w, ggml_transpose(op_ctx, dy));
        ggml_cgraph * graph = ggml_new_graph(op_ctx);
        ggml_build_forward_expand(graph, out);
        ggml_backend_t backends[2] = { gpu, cpu };
        ggml_backend_sched_t sched = ggml_backend_sched_new(backends, nullptr, 2, 64, false, false);
        GGML_ASSERT(ggml_backend_sched_alloc_graph(sched, graph));
        check(ggml_backend_sched_get_tensor_backend(sched, out) == gpu,
              "scheduler places quantized OUT_PROD on the GPU beside its weight");
        ggml_backend_sched_free(sched);
        ggml_free(op_ctx);
        ggml_backend_buffer_free(leaf_buf);
        ggml_free(leaf_ctx);

        // A type outside the handled list stays unclaimed (the CPU keeps it).
        OutProdCase u{"IQ2_XXS", GGML_TYPE_IQ2_XXS, 256, 128, 16, 1, 1, 1, 1, true, false};
        OutProdGraph iq(u, u.type);
        check(!ggml_backend_supports_op(gpu, iq.out), "GPU does not claim OUT_PROD for IQ2_XXS");
    }

    std::string json_bench;
    for (const BenchRow & row : bench) {
        std::vector<double> ratio;
        for (size_t i = 0; i < row.quant_ms.size(); ++i) {
            ratio.push_back(row.quant_ms[i] / row.f32_ms[i]);
        }
        std::vector<double> q = row.quant_ms, f = row.f32_ms, r = ratio;
        std::sort(q.begin(), q.end());
        std::sort(f.begin(), f.end());
        std::sort(r.begin(), r.end());
        const size_t m = r.size() / 2;
        std::printf("bench %-26s quantized %.3f ms  f32 %.3f ms  ratio %.3f [%.3f, %.3f]\n",
                    row.name.c_str(), q[m], f[m], r[m], r.front(), r.back());
        char buf[512];
        std::snprintf(buf, sizeof buf,
                      "{\"case\": \"%s\", \"quant_ms_median\": %.4f, \"f32_ms_median\": %.4f, "
                      "\"ratio_median\": %.4f, \"ratio_min\": %.4f, \"ratio_max\": %.4f, \"rounds\": %zu}",
                      row.name.c_str(), q[m], f[m], r[m], r.front(), r.back(), r.size());
        json_bench += (json_bench.empty() ? "" : ",\n    ") + std::string(buf);
    }

    if (!json_path.empty()) {
        FILE * f = std::fopen(json_path.c_str(), "w");
        GGML_ASSERT(f != nullptr);
        std::fprintf(f, "{\n  \"gpu\": \"%s\",\n  \"math\": \"%s\",\n  \"failures\": %d,\n  \"cases\": [\n    %s\n  ],\n  \"bench\": [\n    %s\n  ]\n}\n",
                     gpu ? ggml_backend_dev_description(ggml_backend_get_device(gpu)) : "",
                     full_fp32 ? "fp32" : "tf32", g_failures, json_cases.c_str(), json_bench.c_str());
        std::fclose(f);
    }

    std::printf("%d failure(s)\n", g_failures);
    if (gpu) {
        ggml_backend_free(gpu);
    }
    ggml_backend_free(cpu);
    return g_failures == 0 ? 0 : 1;
}
