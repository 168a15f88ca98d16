// What the GPU check programs share. The dream stage: rank 2 on all seven targets,
// an f32 training cache, window 96, lr 0 (unless asked), and B's zeros filled from N(0, 0.1)
// (seeded) so that every LoRA factor has a gradient. Returns null with r filled
// when dream_init refuses.
#pragma once

#include "dream.h"

#include <cstdio>
#include <random>
#include <vector>

// The model and context the check programs use: n_gpu_layers as given, no
// extra buffer types (CPU_REPACK), 256 cells, one sequence. The CPU reference
// (n_gpu_layers 0) keeps every op on the CPU: no offload of large-batch ops or
// of the K/V cache to a GPU that a CUDA build would otherwise use. Returns
// false (nothing to free) when the model does not load.
inline bool check_context(const char * path, int n_gpu_layers, llama_model ** model, llama_context ** ctx) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    mp.use_extra_bufts = false;
    *model = llama_model_load_from_file(path, mp);
    if (!*model) {
        std::fprintf(stderr, "load failed\n");
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_seq_max = 1;
    cp.op_offload = n_gpu_layers > 0;
    cp.offload_kqv = n_gpu_layers > 0;
    *ctx = llama_init_from_model(*model, cp);
    return true;
}

// lr > 0: AdamW with that rate, its gradient clipped at norm 0.05 (the checks' gradients are larger), eps 1e-3
inline dream_stage * check_stage(llama_context * ctx, int chunk, bool exact, bool recompute, dream_receipt & r,
                                 float lr = 0.0f) {
    dream_params p = dream_default_params();
    p.targets = "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down";
    p.rank = 2; p.alpha = 4; p.seed = 11; p.context_cache_type = "f32";
    p.window = 96; p.chunk = chunk; p.lr = lr; p.slack_mib = 0;
    if (lr > 0) {
        // eps near the clipped gradient's size keeps the step a smooth function
        // of g: with a tiny eps, AdamW's first steps are about lr x sign(g), and
        // two runs that differ by rounding then differ by 2 lr where g is near 0
        p.grad_clip = 0.05f;
        p.eps = 1e-3f;
    }
    p.exact = exact; p.recompute = recompute; p.horizon = exact ? 0 : -1;
    dream_stage * ds = dream_init(ctx, p, &r);
    if (!ds) {
        std::fprintf(stderr, "dream_init: %s\n", r.message);
        return nullptr;
    }
    const int64_t n = dream_n_params(ds);
    std::vector<float> theta(n);
    dream_get_parameters(ds, theta.data(), n);
    std::mt19937 rng(5);
    std::normal_distribution<float> N(0.0f, 0.1f);
    for (auto & x : theta) if (x == 0.0f) x = N(rng);
    dream_set_parameters(ds, theta.data(), n);
    return ds;
}
