// The exact walk and recompute on the CPU and on the GPU, without Python: the
// tiny model, a 72-token window whose first 12 tokens are unlabelled context,
// rank 2 on all seven targets, an f32 training cache. On each device: the
// one-chunk gradient (the reference: the whole window in one graph, no cache
// read), the exact walk in chunks of 24 and of 16, the exact walk with
// recompute, and the plain walk in chunks of 24 (its cosine, for contrast).
//   dream_exact_check MODEL.gguf
// Prints one JSON line per run. Exit 1 when a run fails or an exact walk's
// gradient is farther from its device's one-chunk gradient than 1e-5 rel L2
// (both sides run the same products on the same device; with TF32 the bound
// is 1e-3, the products' roundoff), or recompute changes the gradient by more
// than 1e-6.
#include "dream.h"
#include "check_stage.h"
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

struct walk_run {
    std::string name;
    int chunk;
    bool exact, recompute;
    std::vector<float> grad;
    double graph_mib = 0, walk_mib = 0;
    int steps = 0;
};

static bool run_walk(llama_context * ctx, const std::vector<llama_token> & toks, const std::vector<uint8_t> & mask,
                     int gpu_layers, walk_run & w) {
    dream_receipt r{};
    dream_stage * ds = check_stage(ctx, w.chunk, w.exact, w.recompute, r);
    if (!ds) return false;
    const int64_t n = dream_n_params(ds);
    dream_window_begin(ds, toks.data(), mask.data(), (int) toks.size(), &r);
    while (dream_chunks_left(ds) > 0) {
        dream_micro_step(ds, &r);
        if (r.status != 0) {
            std::fprintf(stderr, "gpu_layers=%d %s: %s\n", gpu_layers, w.name.c_str(), r.message);
            dream_free(ds);
            return false;
        }
        w.graph_mib = std::max(w.graph_mib, r.graph_mib);
        w.walk_mib = r.walk_mib;
        w.steps += 1;
    }
    w.grad.resize(n);
    dream_gradients(ds, w.grad.data(), n);
    dream_free(ds);
    return true;
}

static double rel_l2(const std::vector<float> & a, const std::vector<float> & ref) {
    double d = 0, g = 0;
    for (size_t i = 0; i < ref.size(); ++i) { d += std::pow((double) a[i] - ref[i], 2); g += std::pow((double) ref[i], 2); }
    return std::sqrt(d / g);
}

static double cosine(const std::vector<float> & a, const std::vector<float> & b) {
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < a.size(); ++i) { ab += (double) a[i] * b[i]; aa += (double) a[i] * a[i]; bb += (double) b[i] * b[i]; }
    return ab / std::sqrt(aa * bb);
}

static bool run_device(const char * path, int gpu_layers, std::vector<walk_run> & runs) {
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    if (!check_context(path, gpu_layers, &model, &ctx)) return false;
    std::vector<llama_token> toks;
    for (int i = 0; i < 72; ++i) toks.push_back(100 + 37 * i % 5000);
    std::vector<uint8_t> mask(toks.size(), 1);
    for (int i = 0; i < 12; ++i) mask[i] = 0;
    bool ok = true;
    for (auto & w : runs) {
        ok = ok && run_walk(ctx, toks, mask, gpu_layers, w);
    }
    llama_free(ctx);
    llama_model_free(model);
    return ok;
}

int main(int argc, char ** argv) {
    if (argc < 2) { std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]); return 2; }
    llama_backend_init();
    const char * tf = std::getenv("NVIDIA_TF32_OVERRIDE");
    const bool fp32 = tf && std::string(tf) == "0";
    bool ok = true;
    std::vector<float> cpu_exact;
    for (int gpu_layers : { 0, 99 }) {
        std::vector<walk_run> runs = {
            { "one_chunk", 96, false, false },
            { "exact_24", 24, true, false },
            { "exact_16", 16, true, false },
            { "exact_16_recompute", 16, true, true },
            { "plain_24", 24, false, false },
        };
        if (!run_device(argv[1], gpu_layers, runs)) {
            std::printf("FAILED: a run on gpu_layers=%d did not complete\n", gpu_layers);
            return 1;
        }
        const auto & ref = runs[0].grad;
        const double bound = gpu_layers == 0 || fp32 ? 1e-5 : 1e-3;
        for (const auto & w : runs) {
            const double rel = rel_l2(w.grad, ref), cos = cosine(w.grad, ref);
            std::printf("{\"gpu_layers\": %d, \"math\": \"%s\", \"walk\": \"%s\", \"chunk\": %d, \"steps\": %d, "
                        "\"rel_l2_vs_one_chunk\": %.4e, \"cosine_vs_one_chunk\": %.8f, \"graph_mib\": %.3f, \"walk_mib\": %.4f}\n",
                        gpu_layers, gpu_layers == 0 ? "cpu" : (fp32 ? "fp32" : "tf32"), w.name.c_str(), w.chunk, w.steps,
                        rel, cos, w.graph_mib, w.walk_mib);
            if (w.exact && rel > bound) {
                std::printf("FAILED: %s on gpu_layers=%d is %.3e from the one-chunk gradient (bound %.0e)\n",
                            w.name.c_str(), gpu_layers, rel, bound);
                ok = false;
            }
        }
        const double rc = rel_l2(runs[3].grad, runs[2].grad);
        std::printf("{\"gpu_layers\": %d, \"recompute_vs_not_rel_l2\": %.4e}\n", gpu_layers, rc);
        if (rc > 1e-6) {
            std::printf("FAILED: recompute changed the gradient by %.3e on gpu_layers=%d\n", rc, gpu_layers);
            ok = false;
        }
        if (gpu_layers == 0) {
            cpu_exact = runs[1].grad;
        } else {
            std::printf("{\"exact_24_gpu_vs_cpu_rel_l2\": %.4e}\n", rel_l2(runs[1].grad, cpu_exact));
        }
    }
    return ok ? 0 : 1;
}
