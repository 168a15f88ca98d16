// The dream stage the GPU check programs share: rank 2 on all seven targets,
// an f32 training cache, window 96, lr 0, and B's zeros filled from N(0, 0.1)
// (seeded) so that every LoRA factor has a gradient. Returns null with r filled
// when dream_init refuses.
#pragma once

#include "dream.h"

#include <cstdio>
#include <random>
#include <vector>

inline dream_stage * check_stage(llama_context * ctx, int chunk, bool exact, bool recompute, dream_receipt & r) {
    dream_params p = dream_default_params();
    p.targets = "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down";
    p.rank = 2; p.alpha = 4; p.seed = 11; p.context_cache_type = "f32";
    p.window = 96; p.chunk = chunk; p.lr = 0; p.slack_mib = 0;
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
