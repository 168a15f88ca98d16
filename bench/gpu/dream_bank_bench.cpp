// The adapter bank (dream-bank.cpp) on a GPU: a mixed-batch check and a decode benchmark.
//   dream_bank_bench check MODEL.gguf DIR
//     Two random LoRAs (rank 4 on attn_q,attn_v; rank 8 on attn_q,attn_k,ffn_down) written
//     to DIR. On the CPU (n_gpu_layers 0) and on the GPU (99): three sequences in one batch
//     (seq 0 on A, seq 1 on B, seq 2 on the base), a prompt then STEPS forced tokens, against
//     each one served alone through llama_set_adapters_lora; then the GPU's mixed batch against
//     the CPU's. Prints one JSON object (rel L2 over the logits, argmax agreement); exit 1 when a
//     rel L2 is above TOL (env DREAM_BANK_TOL, 1e-2) or an argmax differs from its reference.
//   dream_bank_bench bench MODEL.gguf DIR [ranks=8] [targets="attn_q,attn_v;all"] [streams=4,8] [reps=3] [n_decode=64]
//     Decode tok/s of S streams (one token each per batch, after a 64-token prompt per stream):
//     the base; one adapter on the context (llama_set_adapters_lora, today's serving); the bank
//     with every stream on one slot; the bank with every stream on its own slot (mixed).
//     Modes alternate within each rep. Prints one JSON object; cost = 1 - mixed / one.
#include "dream.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "split.h"

using clk = std::chrono::steady_clock;

static const int STEPS = 4;

static int fail(const std::string & what) {
    std::fprintf(stderr, "dream_bank_bench: FAILED: %s\n", what.c_str());
    std::printf("FAILED: %s\n", what.c_str());
    return 1;
}

static double rel_l2(const float * x, const float * ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
        num += ((double) x[i] - ref[i]) * ((double) x[i] - ref[i]);
        den += (double) ref[i] * ref[i];
    }
    return std::sqrt(num / den);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

static std::string meta(const llama_model * m, const char * key) {
    char buf[256];
    return llama_model_meta_val_str(m, key, buf, sizeof buf) >= 0 ? buf : "";
}

// A GGUF LoRA with random A (+-1/sqrt(n_in)) and B (N(0, 0.02)) on every layer's targets.
static bool write_lora(const llama_model * m, const std::string & path, int rank, const std::string & targets, uint32_t seed) {
    const std::string arch = meta(m, "general.architecture");
    const int64_t n_embd = llama_model_n_embd(m), n_layer = llama_model_n_layer(m);
    const int64_t n_kv = n_embd / llama_model_n_head(m) * llama_model_n_head_kv(m);
    const int64_t n_ff = std::atoll(meta(m, (arch + ".feed_forward_length").c_str()).c_str());
    auto dims = [&](const std::string & t) -> std::pair<int64_t, int64_t> {
        if (t == "attn_q" || t == "attn_output") return { n_embd, n_embd };
        if (t == "attn_k" || t == "attn_v") return { n_embd, n_kv };
        if (t == "ffn_gate" || t == "ffn_up") return { n_embd, n_ff };
        return { n_ff, n_embd };   // ffn_down
    };
    const auto ts = split(targets, ',');
    size_t bytes = 0;
    for (const auto & t : ts) bytes += (dims(t).first + dims(t).second) * rank * sizeof(float) + 2 * ggml_tensor_overhead();
    ggml_init_params ip = { bytes * n_layer + 1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    gguf_context * g = gguf_init_empty();
    gguf_set_val_str(g, "general.architecture", arch.c_str());
    gguf_set_val_str(g, "general.type", "adapter");
    gguf_set_val_str(g, "adapter.type", "lora");
    gguf_set_val_f32(g, "adapter.lora.alpha", 2.0f * rank);
    std::mt19937 rng(seed);
    std::normal_distribution<float> N(0.0f, 0.02f);
    for (int64_t il = 0; il < n_layer; ++il) {
        for (const auto & t : ts) {
            const auto [n_in, n_out] = dims(t);
            ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, rank);
            ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, rank, n_out);
            ggml_format_name(a, "blk.%d.%s.weight.lora_a", (int) il, t.c_str());
            ggml_format_name(b, "blk.%d.%s.weight.lora_b", (int) il, t.c_str());
            std::uniform_real_distribution<float> U(-1.0f / std::sqrt((float) n_in), 1.0f / std::sqrt((float) n_in));
            for (int64_t i = 0; i < ggml_nelements(a); ++i) ((float *) a->data)[i] = U(rng);
            for (int64_t i = 0; i < ggml_nelements(b); ++i) ((float *) b->data)[i] = N(rng);
            gguf_add_tensor(g, a);
            gguf_add_tensor(g, b);
        }
    }
    const bool ok = gguf_write_to_file(g, path.c_str(), false);
    gguf_free(g);
    ggml_free(ctx);
    return ok;
}

struct entry { llama_token t; llama_pos pos; llama_seq_id seq; bool out; };

static bool decode(llama_context * ctx, const std::vector<entry> & es) {
    llama_batch b = llama_batch_init((int) es.size(), 0, 1);
    for (size_t i = 0; i < es.size(); ++i) {
        b.token[i] = es[i].t; b.pos[i] = es[i].pos; b.n_seq_id[i] = 1; b.seq_id[i][0] = es[i].seq; b.logits[i] = es[i].out;
    }
    b.n_tokens = (int) es.size();
    const int rc = llama_decode(ctx, b);
    llama_batch_free(b);
    return rc == 0;
}

static bool arm(dream_bank * bank, const std::vector<int32_t> & slots) {
    char err[256];
    if (!dream_bank_set_token_adapters(bank, slots.data(), (int32_t) slots.size(), err, sizeof err)) {
        std::fprintf(stderr, "arm: %s\n", err);
        return false;
    }
    return true;
}

// Sequences (slot per sequence; -1 base) fed `prompt` then the forced tokens, all in
// each batch; per sequence its logits rows (1 + STEPS rows of n_vocab).
static bool run_seqs(llama_context * ctx, dream_bank * bank, const std::vector<int32_t> & slots,
                     const std::vector<llama_token> & prompt, const std::vector<llama_token> & forced, int n_vocab,
                     std::vector<std::vector<float>> & rows) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const int S = (int) slots.size(), np = (int) prompt.size();
    rows.assign(S, {});
    std::vector<entry> es;
    std::vector<int32_t> tok_slots;
    for (int s = 0; s < S; ++s) {
        for (int i = 0; i < np; ++i) { es.push_back({ prompt[i], i, s, i == np - 1 }); tok_slots.push_back(slots[s]); }
    }
    for (int step = 0; step <= STEPS; ++step) {
        if (bank && !arm(bank, tok_slots)) return false;
        if (!decode(ctx, es)) return false;
        for (int s = 0; s < S; ++s) {
            const float * lg = llama_get_logits_ith(ctx, step == 0 ? (s + 1) * np - 1 : s);
            rows[s].insert(rows[s].end(), lg, lg + n_vocab);
        }
        if (step == STEPS) break;
        es.clear();
        tok_slots = slots;
        for (int s = 0; s < S; ++s) es.push_back({ forced[step], np + step, s, true });
    }
    if (bank) arm(bank, {});
    return true;
}

static int argmax_agree(const std::vector<float> & x, const std::vector<float> & r, int n_vocab) {
    int same = 0;
    for (size_t o = 0; o < x.size(); o += n_vocab) {
        same += std::max_element(x.begin() + o, x.begin() + o + n_vocab) - (x.begin() + o) ==
                std::max_element(r.begin() + o, r.begin() + o + n_vocab) - (r.begin() + o);
    }
    return same;
}

static int check(const char * model_path, const std::string & dir) {
    const double tol = std::getenv("DREAM_BANK_TOL") ? std::atof(std::getenv("DREAM_BANK_TOL")) : 1e-2;
    std::vector<std::vector<std::vector<float>>> mixed_by_dev;
    std::string out = "{\n  \"check\": \"mixed batch vs each adapter alone\", \"model\": \"" + std::string(model_path) +
                      "\", \"tol\": " + std::to_string(tol) + ", \"devices\": [\n";
    bool ok = true;
    int n_vocab = 0;
    for (int ngl : { 0, 99 }) {
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = ngl;
        llama_model * model = llama_model_load_from_file(model_path, mp);
        if (!model) return fail("model load");
        n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        const std::string fa = dir + "/bank_a.gguf", fb = dir + "/bank_b.gguf";
        if (ngl == 0 && (!write_lora(model, fa, 4, "attn_q,attn_v", 1) || !write_lora(model, fb, 8, "attn_q,attn_k,ffn_down", 2))) {
            return fail("write lora");
        }
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 512; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_seq_max = 3;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) return fail("context");
        std::mt19937 rng(7);
        std::uniform_int_distribution<int> U(0, n_vocab - 1);
        std::vector<llama_token> prompt(24), forced(STEPS);
        for (auto & t : prompt) t = U(rng);
        for (auto & t : forced) t = U(rng);
        // each alone through llama.cpp's own path
        std::vector<std::vector<float>> ref(3), rows;
        for (int k = 0; k < 3; ++k) {
            llama_adapter_lora * ad = k < 2 ? llama_adapter_lora_init(model, (k == 0 ? fa : fb).c_str()) : nullptr;
            float one = 1.0f;
            llama_set_adapters_lora(ctx, ad ? &ad : nullptr, ad ? 1 : 0, ad ? &one : nullptr);
            if (!run_seqs(ctx, nullptr, { -1 }, prompt, forced, n_vocab, rows)) return fail("decode alone");
            ref[k] = rows[0];
            llama_set_adapters_lora(ctx, nullptr, 0, nullptr);
            if (ad) llama_adapter_lora_free(ad);
        }
        char err[512];
        const char * pad = std::getenv("BANK_RANK");       // bank.sh's BANK_RANK: slots padded to it
        dream_bank * bank = dream_bank_init(ctx, 4, std::max(8, pad ? std::atoi(pad) : 0), err, sizeof err);
        if (!bank) return fail(err);
        const int sa = dream_bank_load(bank, fa.c_str(), 1.0f, err, sizeof err);
        const int sb = dream_bank_load(bank, fb.c_str(), 1.0f, err, sizeof err);
        if (sa < 0 || sb < 0) return fail(err);
        if (!run_seqs(ctx, bank, { sa, sb, -1 }, prompt, forced, n_vocab, rows)) return fail("decode mixed");
        mixed_by_dev.push_back(rows);
        out += std::string(ngl ? ",\n" : "") + "    {\"n_gpu_layers\": " + std::to_string(ngl) + ", \"seqs\": [";
        const char * names[3] = { "A", "B", "base" };
        for (int k = 0; k < 3; ++k) {
            const double e = rel_l2(rows[k].data(), ref[k].data(), rows[k].size());
            const double moved = rel_l2(ref[k].data(), ref[2].data(), ref[k].size());
            const int agree = argmax_agree(rows[k], ref[k], n_vocab);
            ok = ok && e <= tol && agree == STEPS + 1;
            char buf[256];
            std::snprintf(buf, sizeof buf, "%s{\"adapter\": \"%s\", \"rel_l2_vs_alone\": %.3e, \"adapter_vs_base\": %.3e, \"argmax_same\": %d}",
                          k ? ", " : "", names[k], e, moved, agree);
            out += buf;
        }
        out += "]}";
        dream_bank_free(bank);
        llama_free(ctx);
        llama_model_free(model);
    }
    out += "\n  ], \"gpu_vs_cpu_mixed\": [";
    for (int k = 0; k < 3; ++k) {
        const auto & g = mixed_by_dev[1][k], & c = mixed_by_dev[0][k];
        const double e = rel_l2(g.data(), c.data(), g.size());
        ok = ok && e <= tol;
        char buf[128];
        std::snprintf(buf, sizeof buf, "%s{\"rel_l2\": %.3e, \"argmax_same\": %d}", k ? ", " : "", e, argmax_agree(g, c, n_vocab));
        out += buf;
    }
    out += std::string("],\n  \"pass\": ") + (ok ? "true" : "false") + "\n}\n";
    std::fputs(out.c_str(), stdout);
    return ok ? 0 : 1;
}

// S streams: a 64-token prompt each (one batch), then n_decode batches of S tokens. Decode tok/s.
static double stream_decode(llama_context * ctx, dream_bank * bank, const std::vector<int32_t> & slots, int n_decode,
                            int n_vocab) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const int S = (int) slots.size(), np = 64;
    std::mt19937 rng(3);
    std::uniform_int_distribution<int> U(0, n_vocab - 1);
    std::vector<entry> es;
    std::vector<int32_t> tok_slots;
    for (int s = 0; s < S; ++s) {
        for (int i = 0; i < np; ++i) { es.push_back({ U(rng), i, s, i == np - 1 }); tok_slots.push_back(slots[s]); }
    }
    if (bank && !arm(bank, tok_slots)) return -1;
    if (!decode(ctx, es)) return -1;
    llama_synchronize(ctx);
    const auto t0 = clk::now();
    for (int step = 0; step < n_decode; ++step) {
        es.clear();
        for (int s = 0; s < S; ++s) {
            const float * lg = llama_get_logits_ith(ctx, step == 0 ? (s + 1) * np - 1 : s);
            es.push_back({ (llama_token) (std::max_element(lg, lg + n_vocab) - lg), np + step, s, true });
        }
        if (bank && !arm(bank, slots)) return -1;
        if (!decode(ctx, es)) return -1;
    }
    llama_synchronize(ctx);
    const double dt = std::chrono::duration<double>(clk::now() - t0).count();
    if (bank) arm(bank, {});
    return S * n_decode / dt;
}

static int bench(int argc, char ** argv) {
    const char * model_path = argv[2];
    const std::string dir = argv[3];
    std::vector<int> ranks, streams;
    for (const auto & r : split(argc > 4 ? argv[4] : "8", ',')) ranks.push_back(std::atoi(r.c_str()));
    std::vector<std::string> target_sets;
    for (const auto & t : split(argc > 5 ? argv[5] : "attn_q,attn_v;all", ';')) {
        target_sets.push_back(t == "all" ? "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down" : t);
    }
    for (const auto & s : split(argc > 6 ? argv[6] : "4,8", ',')) streams.push_back(std::atoi(s.c_str()));
    const int reps = argc > 7 ? std::max(1, std::atoi(argv[7])) : 3;
    const int n_decode = argc > 8 ? std::max(8, std::atoi(argv[8])) : 64;
    const int bank_rank = argc > 9 ? std::atoi(argv[9]) : 0;     // the bank's max_rank; 0: the adapters' rank
    const int max_s = *std::max_element(streams.begin(), streams.end());

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 99;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) return fail("model load");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256 * max_s; cp.n_batch = 64 * max_s; cp.n_ubatch = 64 * max_s; cp.n_seq_max = max_s;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) return fail("context");
    std::string out = "{\n  \"bench\": \"decode, streams on adapters\", \"model\": \"" + std::string(model_path) +
                      "\", \"n_decode\": " + std::to_string(n_decode) + ", \"bank_rank\": " + std::to_string(bank_rank) + ", \"reps\": " + std::to_string(reps) + ", \"runs\": [\n";
    bool first = true;
    for (int rank : ranks) {
        for (const auto & targets : target_sets) {
            char err[512];
            dream_bank * bank = dream_bank_init(ctx, max_s, std::max(rank, bank_rank), err, sizeof err);
            if (!bank) return fail(err);
            std::vector<llama_adapter_lora *> ads;
            for (int i = 0; i < max_s; ++i) {
                const std::string f = dir + "/bench_" + std::to_string(i) + ".gguf";
                if (!write_lora(model, f, rank, targets, 100 + i)) return fail("write lora");
                if (dream_bank_load(bank, f.c_str(), 1.0f, err, sizeof err) != i) return fail(err);
                if (i == 0) ads.push_back(llama_adapter_lora_init(model, f.c_str()));
            }
            const double slot_mib = dream_bank_slot_bytes(bank, 0) / 1048576.0;
            for (int S : streams) {
                std::vector<int32_t> base(S, -1), one(S, 0), mixed(S);
                for (int s = 0; s < S; ++s) mixed[s] = s;
                std::vector<double> t_base, t_one, t_bank_one, t_mixed;
                float scale = 1.0f;
                for (int rep = -1; rep < reps; ++rep) {    // rep -1: warm-up
                    const double a = stream_decode(ctx, nullptr, base, n_decode, n_vocab);
                    llama_set_adapters_lora(ctx, ads.data(), 1, &scale);
                    const double b = stream_decode(ctx, nullptr, base, n_decode, n_vocab);
                    llama_set_adapters_lora(ctx, nullptr, 0, nullptr);
                    const double c = stream_decode(ctx, bank, one, n_decode, n_vocab);
                    const double d = stream_decode(ctx, bank, mixed, n_decode, n_vocab);
                    if (a < 0 || b < 0 || c < 0 || d < 0) return fail("decode");
                    if (rep >= 0) { t_base.push_back(a); t_one.push_back(b); t_bank_one.push_back(c); t_mixed.push_back(d); }
                }
                char buf[768];
                const double mb = median(t_base), mo = median(t_one), mbo = median(t_bank_one), mm = median(t_mixed);
                std::snprintf(buf, sizeof buf,
                              "%s    {\"rank\": %d, \"targets\": \"%s\", \"streams\": %d, \"tok_s_base\": %.1f, \"tok_s_one_adapter\": %.1f, "
                              "\"tok_s_bank_one_slot\": %.1f, \"tok_s_mixed\": %.1f, \"cost_mixed_vs_one\": %.4f, "
                              "\"cost_one_vs_base\": %.4f, \"slot_mib\": %.2f}",
                              first ? "" : ",\n", rank, targets.c_str(), S, mb, mo, mbo, mm, 1.0 - mm / mo, 1.0 - mo / mb, slot_mib);
                out += buf;
                first = false;
                std::fprintf(stderr, "%s\n", buf);
            }
            for (auto * a : ads) llama_adapter_lora_free(a);
            dream_bank_free(bank);
        }
    }
    out += "\n  ]\n}\n";
    std::fputs(out.c_str(), stdout);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s check MODEL.gguf DIR | bench MODEL.gguf DIR [ranks] [targets] [streams] [reps] [n_decode] [bank_rank]\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    const std::string mode = argv[1];
    if (mode == "check") return check(argv[2], argv[3]);
    if (mode == "bench") return bench(argc, argv);
    return fail("unknown mode " + mode);
}
