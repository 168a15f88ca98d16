// Decode speed with a served dream adapter against the bare model, side by side.
//   dream_decode_bench MODEL.gguf [n_gpu_layers=99] [ranks=8] [targets="attn_q,attn_v;all"] [reps=5]
//                      [n_decode=128]
// targets: sets separated by ';' ("all" = the seven linear targets).
// For each rank R and target set T: a dream stage on the resident context trains
// a few steps at a high learning rate (so B is far from zero), promotes, and then
// greedy decodes of n_decode tokens after a 64-token prompt alternate, reps
// times, between the bare model and the model with the adapter, so both see the
// same machine state. Prints one JSON object: decode tok/s (medians and every
// rep) both ways and the cost (1 - with / without).
// ggml-cuda's LoRA decode fusion (patch 0104) is on unless the environment sets
// DREAMSTAGE_LORA_FUSION=0; run.sh runs both, in alternating processes. (Switching
// it inside one process is not measured here: ggml-cuda would replay the CUDA
// graph it captured the other way, since the ggml graph is the same.
// dream_lora_check compares the two ways op by op.) Exit 1 when the fused kernel
// did not run with the fusion on, or ran with it off.
#include "dream.h"
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <random>
#include <string>
#include <vector>

#include "split.h"

using clk = std::chrono::steady_clock;

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

static int fail(const char * what) {
    std::fprintf(stderr, "dream_decode_bench: FAILED: %s\n", what);
    std::printf("FAILED: %s\n", what);
    return 1;
}

static bool decode_one(llama_context * ctx, llama_token t, llama_pos pos, bool all_logits = true) {
    llama_batch b = llama_batch_init(1, 0, 1);
    b.token[0] = t; b.pos[0] = pos; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0; b.logits[0] = all_logits; b.n_tokens = 1;
    const int rc = llama_decode(ctx, b);
    llama_batch_free(b);
    return rc == 0;
}

// A 64-token prompt, then n greedy tokens one at a time; tok/s of the n, the tokens in *out.
static double greedy(llama_context * ctx, int n_vocab, const std::vector<llama_token> & prompt, int n,
                     std::vector<llama_token> * out) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const int np = (int) prompt.size();
    llama_batch b = llama_batch_init(np, 0, 1);
    for (int i = 0; i < np; ++i) {
        b.token[i] = prompt[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = i == np - 1;
    }
    b.n_tokens = np;
    const int rc = llama_decode(ctx, b);
    llama_batch_free(b);
    if (rc) return -1;
    const float * lg = llama_get_logits_ith(ctx, -1);
    llama_token next = (llama_token) (std::max_element(lg, lg + n_vocab) - lg);
    out->clear();
    llama_synchronize(ctx);
    const auto t0 = clk::now();
    for (int i = 0; i < n; ++i) {
        out->push_back(next);
        if (!decode_one(ctx, next, np + i)) return -1;
        lg = llama_get_logits_ith(ctx, -1);
        next = (llama_token) (std::max_element(lg, lg + n_vocab) - lg);
    }
    llama_synchronize(ctx);
    return n / std::chrono::duration<double>(clk::now() - t0).count();
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [n_gpu_layers] [ranks] [targets] [reps] [n_decode]\n", argv[0]);
        return 2;
    }
    const int ngl = argc > 2 ? std::atoi(argv[2]) : 99;
    std::vector<int> ranks;
    std::vector<std::string> target_sets;
    for (const auto & r : split(argc > 3 ? argv[3] : "8", ',')) ranks.push_back(std::atoi(r.c_str()));
    for (const auto & t : split(argc > 4 ? argv[4] : "attn_q,attn_v;all", ';')) {
        target_sets.push_back(t == "all" ? "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down" : t);
    }
    const int reps = argc > 5 ? std::max(1, std::atoi(argv[5])) : 5;
    const int n_decode = argc > 6 ? std::max(8, std::atoi(argv[6])) : 128;
    const char * fusion = std::getenv("DREAMSTAGE_LORA_FUSION");
    const bool fusion_on = fusion == nullptr || std::atoi(fusion) != 0;
    // the fused kernels launched so far (ggml-cuda, patch 0104; absent on a CPU build)
    auto fusion_runs = (long long (*)()) dlsym(RTLD_DEFAULT, "dream_cuda_lora_fusion_runs");

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fail("model load");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("context");

    std::mt19937 rng(11);
    std::uniform_int_distribution<int> U(0, n_vocab - 1);
    std::vector<llama_token> prompt(64), train(128);
    for (auto & t : prompt) t = U(rng);
    for (auto & t : train) t = U(rng);

    std::string out = "{\n  \"model\": \"" + std::string(argv[1]) + "\", \"n_gpu_layers\": " + std::to_string(ngl) +
                      ", \"n_decode\": " + std::to_string(n_decode) + ", \"reps\": " + std::to_string(reps) +
                      ",\n  \"lora_fusion\": \"" + (fusion ? fusion : "default (on)") + "\",\n  \"runs\": [\n";
    for (size_t ri = 0; ri < ranks.size(); ++ri) {
        for (size_t ti = 0; ti < target_sets.size(); ++ti) {
            dream_params p = dream_default_params();
            p.rank = ranks[ri]; p.alpha = 2.0f * p.rank; p.targets = target_sets[ti].c_str(); p.context_cache_type = "q8_0";
            p.window = 128; p.chunk = 128; p.lr = 1e-2f;
            dream_receipt r{};
            dream_stage * ds = dream_init(ctx, p, &r);
            if (!ds) { std::fprintf(stderr, "dream_init: %s\n", r.message); return fail("dream_init"); }
            std::vector<uint8_t> mask(train.size(), 1);
            for (int i = 0; i < 4; ++i) {
                if (dream_window_begin(ds, train.data(), mask.data(), (int) train.size(), &r) != DREAM_STATUS_OK ||
                    dream_micro_step(ds, &r) != DREAM_STATUS_OK) {
                    std::fprintf(stderr, "step: %s\n", r.message); return fail("training step");
                }
            }
            if (dream_promote(ds) < 1) return fail("promote");
            llama_adapter_lora * served = dream_served_adapter(ds);
            float scale = 1.0f;
            std::vector<double> without, with;
            std::vector<llama_token> toks_without, toks_with;
            for (int rep = -1; rep < reps; ++rep) {     // rep -1: warm-up both ways
                llama_set_adapters_lora(ctx, nullptr, 0, nullptr);
                const double a = greedy(ctx, n_vocab, prompt, n_decode, &toks_without);
                if (llama_set_adapters_lora(ctx, &served, 1, &scale) != 0) return fail("set adapter");
                const double b = greedy(ctx, n_vocab, prompt, n_decode, &toks_with);
                if (a < 0 || b < 0) return fail("decode");
                if (rep >= 0) { without.push_back(a); with.push_back(b); }
            }
            llama_set_adapters_lora(ctx, nullptr, 0, nullptr);
            // the decodes with the adapter went through the fusion exactly when it is on
            // (a replayed CUDA graph launches nothing from the host, so only "some" is checked)
            const long long fused = fusion_runs ? fusion_runs() : -1;
            if (fusion_runs && fusion_on != (fused > 0)) return fail("the LoRA decode fusion did not run as set");
            size_t same = 0;
            while (same < toks_with.size() && toks_with[same] == toks_without[same]) ++same;
            std::string tk;
            for (size_t i = 0; i < std::min<size_t>(16, toks_with.size()); ++i) tk += (i ? "," : "") + std::to_string(toks_with[i]);
            char buf[1024];
            const double mw = median(without), mv = median(with);
            std::snprintf(buf, sizeof buf,
                          "    {\"rank\": %d, \"targets\": \"%s\", \"decode_tok_s_without\": %.1f, \"decode_tok_s_with\": %.1f, "
                          "\"cost\": %.4f, \"fused_launches_so_far\": %lld,\n     ", ranks[ri], target_sets[ti].c_str(), mw, mv,
                          1.0 - mv / mw, fused);
            out += buf;
            const std::pair<const char *, std::vector<double> *> lists[2] = { { "without_all", &without }, { "with_all", &with } };
            for (const auto & [name, vals] : lists) {
                out += std::string("\"") + name + "\": [";
                for (size_t i = 0; i < vals->size(); ++i) { std::snprintf(buf, sizeof buf, "%s%.1f", i ? ", " : "", (*vals)[i]); out += buf; }
                out += "], ";
            }
            std::snprintf(buf, sizeof buf, "\n     \"tokens_with\": [%s], \"tokens_same_as_base\": %zu}", tk.c_str(), same);
            out += buf;
            out += (ri + 1 < ranks.size() || ti + 1 < target_sets.size()) ? ",\n" : "\n";
            dream_free(ds);
        }
    }
    out += "  ]\n}\n";
    std::fputs(out.c_str(), stdout);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
