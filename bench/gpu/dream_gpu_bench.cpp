// GPU throughput of the dream stage on the resident context, without Python.
//   dream_gpu_bench MODEL.gguf [n_gpu_layers=99] [chunks=128,512,2048] [reps=7] [ranks=8] [targets=attn_q,attn_v]
// targets: sets separated by ';' ("all" = the seven linear targets).
// One model, one llama_context. For each rank R, target set T and chunk size C
// (one stage each, window = C, so every micro-step is one chunk forward +
// backward + one AdamW update), interleaved with serving prefill of 512 tokens:
//   prefill(A) x reps, micro-step(B) x reps, prefill(A) x reps
// Reports median / min / max of each, trained tok/s from the receipt's ms and from
// wall time around dream_micro_step, graph_mib and context_mib from the receipts,
// the GPU's free memory before the job, with it, and after it is freed, serving's
// compute buffer and the training graph's scheduler splits,
// then promotes the adapter, serves with it (prefill + greedy decode) and checks
// the logits are finite and differ from the base model's. Prints one JSON object.
#include "dream.h"
#include "llama.h"

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

using clk = std::chrono::steady_clock;

static double ms_since(clk::time_point t0) {
    return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}

struct stats { double median = 0, min = 0, max = 0; int n = 0; };

static stats summarize(std::vector<double> v) {
    stats s;
    if (v.empty()) return s;
    std::sort(v.begin(), v.end());
    s.n = (int) v.size();
    s.min = v.front();
    s.max = v.back();
    s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    return s;
}

static std::string js(const stats & s) {
    char b[160];
    std::snprintf(b, sizeof b, "{\"median\": %.3f, \"min\": %.3f, \"max\": %.3f, \"n\": %d}", s.median, s.min, s.max, s.n);
    return b;
}

static int fail(const char * what) {
    std::fprintf(stderr, "dream_gpu_bench: FAILED: %s\n", what);
    std::printf("FAILED: %s\n", what);
    return 1;
}

// Prefill of toks[0..n) from an empty cache, logits for the last token only; ms.
static double prefill_ms(llama_context * ctx, std::vector<llama_token> & toks, int n, int * rc) {
    llama_memory_clear(llama_get_memory(ctx), true);
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; ++i) {
        b.token[i] = toks[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = i == n - 1;
    }
    b.n_tokens = n;
    const auto t0 = clk::now();
    *rc = llama_decode(ctx, b);
    llama_synchronize(ctx);
    const double ms = ms_since(t0);
    llama_batch_free(b);
    return ms;
}

// Greedy decode of n tokens after a prefill of 64; returns decode tok/s, fills the first logits row.
static double serve(llama_context * ctx, const llama_vocab * vocab, std::vector<llama_token> & toks, int n,
                    std::vector<float> & first_logits, int * rc) {
    const int n_vocab = llama_vocab_n_tokens(vocab);
    prefill_ms(ctx, toks, 64, rc);
    if (*rc) return 0;
    const float * lg = llama_get_logits_ith(ctx, -1);
    first_logits.assign(lg, lg + n_vocab);
    llama_token next = (llama_token) (std::max_element(lg, lg + n_vocab) - lg);
    const auto t0 = clk::now();
    for (int i = 0; i < n; ++i) {
        llama_pos pos = 64 + i;
        llama_batch b = llama_batch_init(1, 0, 1);
        b.token[0] = next; b.pos[0] = pos; b.n_seq_id[0] = 1; b.seq_id[0][0] = 0; b.logits[0] = 1; b.n_tokens = 1;
        *rc = llama_decode(ctx, b);
        llama_batch_free(b);
        if (*rc) return 0;
        lg = llama_get_logits_ith(ctx, -1);
        next = (llama_token) (std::max_element(lg, lg + n_vocab) - lg);
    }
    llama_synchronize(ctx);
    return n / (ms_since(t0) / 1000.0);
}

// "a,b,c" -> {"a", "b", "c"}
// The model FLOPs of one LoRA training step on `n` tokens (the count peft_bench.step_flops uses):
// 2 x multiply-adds of every frozen product forward and of its input's gradient (the LoRA's own left
// out), plus causal attention's QK^T and PV over half the square, forward and four backward products.
static double step_flops(const llama_model * model, int n) {
    const double E = llama_model_n_embd(model), L = llama_model_n_layer(model), H = llama_model_n_head(model),
                 Hkv = llama_model_n_head_kv(model), V = llama_vocab_n_tokens(llama_model_get_vocab(model));
    char arch[64] = "llama", key[128], val[32];
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch);
    std::snprintf(key, sizeof key, "%s.feed_forward_length", arch);
    const double F = llama_model_meta_val_str(model, key, val, sizeof val) > 0 ? std::atof(val) : 4 * E;
    const double head = E / H;
    const double products = (double) n * (L * (2 * E * E + 2 * E * head * Hkv + 3 * E * F) + E * V);
    const double attention = L * H * head * (double) n * n;
    return 2.0 * (2.0 * products + 3.0 * attention);
}

static std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    for (size_t p = 0; p < s.size();) {
        size_t q = s.find(sep, p);
        if (q == std::string::npos) q = s.size();
        out.push_back(s.substr(p, q - p));
        p = q + 1;
    }
    return out;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [n_gpu_layers] [chunks] [reps] [ranks] [targets]\n", argv[0]);
        return 2;
    }
    const int ngl = argc > 2 ? std::atoi(argv[2]) : 99;
    std::vector<int> chunks, ranks;
    for (const auto & c : split(argc > 3 ? argv[3] : "128,512,2048", ',')) chunks.push_back(std::atoi(c.c_str()));
    const int reps = argc > 4 ? std::max(3, std::atoi(argv[4])) : 7;
    for (const auto & r : split(argc > 5 ? argv[5] : "8", ',')) ranks.push_back(std::atoi(r.c_str()));
    std::vector<std::string> target_sets;
    for (const auto & t : split(argc > 6 ? argv[6] : "attn_q,attn_v", ';')) {
        target_sets.push_back(t == "all" ? "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down" : t);
    }
    struct config { int rank; std::string targets; int chunk; };
    std::vector<config> configs;
    for (int R : ranks) for (const auto & T : target_sets) for (int C : chunks) configs.push_back({ R, T, C });
    const int n_prefill = 512;
    const int max_chunk = *std::max_element(chunks.begin(), chunks.end());

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    const auto tl = clk::now();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fail("model load");
    const double load_ms = ms_since(tl);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = std::max(4096, max_chunk);
    cp.n_batch = 2048; cp.n_ubatch = 512; cp.n_seq_max = 1;
    // every core for the CPU's part of a step (the token embeddings: llama keeps the
    // input layer in host memory), as `dreamstage serve` sets it by default; the
    // context default is 4 threads
    cp.n_threads = cp.n_threads_batch = (int32_t) std::max(1u, std::thread::hardware_concurrency());
    if (const char * t = std::getenv("DREAM_BENCH_THREADS")) {   // fewer, for a same-run comparison
        cp.n_threads = cp.n_threads_batch = std::max(1, std::atoi(t));
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("context");

    std::mt19937 rng(7);
    std::uniform_int_distribution<int> U(0, n_vocab - 1);
    std::vector<llama_token> toks(std::max(max_chunk, n_prefill));
    for (auto & t : toks) t = U(rng);

    int rc = 0;
    std::vector<float> base_logits;
    const double decode_before = serve(ctx, vocab, toks, 64, base_logits, &rc);
    if (rc) return fail("decode before training");
    for (int i = 0; i < 2; ++i) prefill_ms(ctx, toks, n_prefill, &rc);   // warm-up
    if (rc) return fail("prefill warm-up");

    std::string out = "{\n";
    char buf[4096];
    std::snprintf(buf, sizeof buf, "  \"build\": \"%s\",\n  \"model\": \"%s\",\n  \"n_gpu_layers\": %d,\n  \"n_ctx\": %u, \"n_batch\": %u, \"n_ubatch\": %u,\n"
                  "  \"load_ms\": %.0f,\n  \"reps\": %d,\n  \"decode_tok_s_before_training\": %.1f,\n  \"runs\": [\n",
                  dream_build_info(), argv[1], ngl, llama_n_ctx(ctx), llama_n_batch(ctx), llama_n_ubatch(ctx), load_ms, reps, decode_before);
    out += buf;

    // the GPU (the first non-CPU device) and its free memory
    ggml_backend_dev_t gpu = nullptr;
    for (size_t i = 0; i < ggml_backend_dev_count() && !gpu; ++i) {
        if (ggml_backend_dev_type(ggml_backend_dev_get(i)) == GGML_BACKEND_DEVICE_TYPE_GPU) gpu = ggml_backend_dev_get(i);
    }
    auto free_mib = [&]() {
        size_t f = 0, t = 0;
        if (gpu) ggml_backend_dev_memory(gpu, &f, &t);
        return f / 1048576.0;
    };
    const size_t serving_bytes_before = dream_serving_compute_bytes(ctx);

    dream_stage * last = nullptr;
    bool all_loss_fell = true;
    std::vector<double> all_prefill;
    for (size_t ci = 0; ci < configs.size(); ++ci) {
        const int C = configs[ci].chunk;
        if (last) { dream_free(last); last = nullptr; }   // one stage on the context at a time
        const double free_before = free_mib();
        dream_params p = dream_default_params();
        p.rank = configs[ci].rank; p.alpha = 2.0f * p.rank; p.targets = configs[ci].targets.c_str(); p.context_cache_type = "q8_0";
        p.window = C; p.chunk = C; p.lr = 1e-3f;
        dream_receipt r{};
        std::vector<uint8_t> mask(C, 1);
        // the same steps with attention as explicit products first (DREAMSTAGE_FUSED_ATTN=0,
        // the path before fused attention), in a stage of its own, freed before the next
        std::vector<double> explicit_ms;
        double explicit_graph_mib = 0;
        // DREAM_BENCH_QUICK=1 skips this and the steps without graph reuse (same-run A/B runs)
        const bool quick = std::getenv("DREAM_BENCH_QUICK") && std::strcmp(std::getenv("DREAM_BENCH_QUICK"), "1") == 0;
        if (!quick) {
            setenv("DREAMSTAGE_FUSED_ATTN", "0", 1);
            dream_stage * de = dream_init(ctx, p, &r);
            unsetenv("DREAMSTAGE_FUSED_ATTN");
            if (!de) { std::fprintf(stderr, "dream_init: %s\n", r.message); return fail("dream_init (explicit attention)"); }
            for (int i = 0; i < reps + 2; ++i) {
                if (dream_window_begin(de, toks.data(), mask.data(), C, &r) != DREAM_STATUS_OK ||
                    dream_micro_step(de, &r) != DREAM_STATUS_OK || !std::isfinite(r.loss)) {
                    std::fprintf(stderr, "explicit attention step: %s\n", r.message);
                    return fail("explicit attention step");
                }
                std::fprintf(stderr, "chunk %d explicit step %d loss %.4f ms %.2f graph_mib %.1f\n", C, i, r.loss, r.ms, r.graph_mib);
                if (i >= 2) explicit_ms.push_back(r.ms);
                explicit_graph_mib = r.graph_mib;
            }
            dream_free(de);
        }
        dream_stage * ds = dream_init(ctx, p, &r);
        if (!ds) { std::fprintf(stderr, "dream_init: %s\n", r.message); return fail("dream_init"); }
        std::vector<double> pre, step_ms, wall_ms, loss;
        double graph_mib = 0, context_mib = 0, adapter_mib = 0, optimizer_mib = 0;
        auto do_prefill = [&](std::vector<double> & v) {
            for (int i = 0; i < reps; ++i) {
                const double ms = prefill_ms(ctx, toks, n_prefill, &rc);
                if (rc) return false;
                v.push_back(n_prefill / (ms / 1000.0));
            }
            return true;
        };
        if (!do_prefill(pre)) return fail("prefill before steps");
        // one micro-step on the window (one chunk), checked (FAILED printed on any failure)
        auto step = [&](int i, double * wall) {
            if (dream_window_begin(ds, toks.data(), mask.data(), C, &r) != DREAM_STATUS_OK) {
                std::fprintf(stderr, "window_begin: %s\n", r.message);
                fail("dream_window_begin");
                return false;
            }
            const auto t0 = clk::now();
            const int st = dream_micro_step(ds, &r);
            *wall = ms_since(t0);
            std::fprintf(stderr, "chunk %d step %d status %d loss %.4f ms %.2f wall %.2f graph_mib %.1f context_mib %.2f %s\n",
                         C, i, st, r.loss, r.ms, *wall, r.graph_mib, r.context_mib, r.message);
            if (st != DREAM_STATUS_OK) { fail(r.message); return false; }
            if (r.chunk_tokens != C || dream_chunks_left(ds) != 0) { fail("a window of one chunk took more than one micro-step"); return false; }
            if (!std::isfinite(r.loss)) { fail("loss not finite"); return false; }
            return true;
        };
        // the same steps with graph reuse off first (every step builds, plans and
        // allocates its graph), then on (the default; the first step builds)
        std::vector<double> fresh_ms;
        dream_set_graph_reuse(ds, false);
        for (int i = 0; i < (quick ? 0 : reps + 2); ++i) {
            double wall = 0;
            if (!step(i, &wall)) return 1;
            if (i >= 2) fresh_ms.push_back(r.ms);
        }
        dream_set_graph_reuse(ds, true);
        for (int i = 0; i < reps + 2; ++i) {   // two warm-up steps
            double wall = 0;
            if (!step(i, &wall)) return 1;
            loss.push_back(r.loss);
            if (i < 2) continue;
            step_ms.push_back(r.ms);
            wall_ms.push_back(wall);
            graph_mib = r.graph_mib; context_mib = r.context_mib; adapter_mib = r.adapter_mib; optimizer_mib = r.optimizer_mib;
        }
        const double free_during = free_mib();
        const int n_splits = dream_last_n_splits(ds);
        if (!do_prefill(pre)) return fail("prefill after steps");
        all_prefill.insert(all_prefill.end(), pre.begin(), pre.end());
        auto tok_s = [C](const std::vector<double> & ms) {
            std::vector<double> v;
            for (double x : ms) v.push_back(C / (x / 1000.0));
            return v;
        };
        const std::vector<double> tps = tok_s(step_ms), tps_wall = tok_s(wall_ms), tps_fresh = tok_s(fresh_ms),
                                  tps_explicit = tok_s(explicit_ms);
        const long long reuses = (long long) dream_graph_reuses(ds);
        // same window every step at lr 1e-3: the loss must fall
        const bool loss_fell = loss.back() < loss.front();
        // model FLOP/s at the median step, and its share of the card's dense bf16 rate (DREAM_PEAK_TFLOPS, an H100 SXM's by default)
        const double tflop_s = step_flops(model, C) / (summarize(step_ms).median / 1000.0) / 1e12;
        const char * peak_env = std::getenv("DREAM_PEAK_TFLOPS");
        const double peak = peak_env ? std::atof(peak_env) : 989.0;
        std::snprintf(buf, sizeof buf,
                      "    {\"chunk\": %d, \"window\": %d, \"rank\": %d, \"targets\": \"%s\", \"context_cache_type\": \"q8_0\",\n"
                      "     \"n_splits\": %d, \"gpu_free_mib_before\": %.0f, \"gpu_free_mib_during\": %.0f,\n"
                      "     \"prefill512_tok_s\": %s,\n     \"step_ms\": %s,\n     \"step_wall_ms\": %s,\n"
                      "     \"train_tok_s\": %s,\n     \"train_tok_s_wall\": %s,\n"
                      "     \"train_tok_s_without_graph_reuse\": %s,\n     \"graph_reuses\": %lld,\n"
                      "     \"optimizer_on_device\": %s, \"fused_attention\": %s, \"train_tok_s_explicit_attention\": %s, \"graph_mib_explicit_attention\": %.1f,\n"
                      "     \"graph_mib\": %.1f, \"context_mib\": %.2f, \"adapter_mib\": %.2f, \"optimizer_mib\": %.2f,\n"
                      "     \"model_tflop_s\": %.1f, \"mfu\": %.4f,\n"
                      "     \"loss_first\": %.4f, \"loss_last\": %.4f, \"loss_fell\": %s}%s\n",
                      C, C, configs[ci].rank, configs[ci].targets.c_str(), n_splits, free_before, free_during, js(summarize(pre)).c_str(), js(summarize(step_ms)).c_str(), js(summarize(wall_ms)).c_str(),
                      js(summarize(tps)).c_str(), js(summarize(tps_wall)).c_str(), js(summarize(tps_fresh)).c_str(), reuses,
                      dream_optimizer_on_device(ds) ? "true" : "false", dream_fused_attention(ds) ? "true" : "false", js(summarize(tps_explicit)).c_str(), explicit_graph_mib, graph_mib, context_mib, adapter_mib, optimizer_mib,
                      tflop_s, tflop_s / peak, loss.front(), loss.back(), loss_fell ? "true" : "false", ci + 1 < configs.size() ? "," : "");
        out += buf;
        all_loss_fell = all_loss_fell && loss_fell;
        last = ds;
    }
    out += "  ],\n";
    const size_t serving_bytes_after = dream_serving_compute_bytes(ctx);

    // serving after training, with the trained adapter promoted and applied
    const int64_t version = dream_promote(last);
    llama_adapter_lora * served = dream_served_adapter(last);
    float scale = 1.0f;
    if (version < 1 || !served || llama_set_adapters_lora(ctx, &served, 1, &scale) != 0) return fail("promote/apply");
    std::vector<float> lora_logits;
    const double decode_after = serve(ctx, vocab, toks, 64, lora_logits, &rc);
    if (rc) return fail("decode after training");
    double diff = 0, norm = 0;
    bool finite = true;
    for (int i = 0; i < n_vocab; ++i) {
        finite = finite && std::isfinite(lora_logits[i]);
        diff += std::pow((double) lora_logits[i] - base_logits[i], 2);
        norm += std::pow((double) base_logits[i], 2);
    }
    std::vector<double> pre_after;
    for (int i = 0; i < reps; ++i) {
        const double ms = prefill_ms(ctx, toks, n_prefill, &rc);
        if (rc) return fail("prefill with the served adapter");
        pre_after.push_back(n_prefill / (ms / 1000.0));
    }
    dream_free(last);
    last = nullptr;
    const double free_after_job = free_mib();
    std::snprintf(buf, sizeof buf,
                  "  \"serving_compute_bytes_before\": %zu, \"serving_compute_bytes_after\": %zu, \"gpu_free_mib_after_job\": %.0f,\n"
                  "  \"served_rank\": %d, \"served_targets\": \"%s\",\n"
                  "  \"prefill512_tok_s_all\": %s,\n  \"served_version\": %lld,\n  \"decode_tok_s_after_training_with_adapter\": %.1f,\n"
                  "  \"prefill512_tok_s_with_adapter\": %s,\n  \"served_logits_rel_change\": %.4e,\n  \"served_logits_finite\": %s\n}\n",
                  serving_bytes_before, serving_bytes_after, free_after_job, configs.back().rank, configs.back().targets.c_str(),
                  js(summarize(all_prefill)).c_str(), (long long) version, decode_after, js(summarize(pre_after)).c_str(),
                  std::sqrt(diff / norm), finite ? "true" : "false");
    out += buf;
    std::fputs(out.c_str(), stdout);
    if (!all_loss_fell) return fail("loss did not fall over repeated updates on one window");
    if (!finite) return fail("served logits not finite");
    if (!(diff > 0)) return fail("the served adapter did not change the logits");
    llama_set_adapters_lora(ctx, nullptr, 0, nullptr);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
