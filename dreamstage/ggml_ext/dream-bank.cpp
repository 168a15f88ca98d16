// The adapter bank: up to `capacity` GGUF LoRA adapters resident for serving,
// applied per token inside one decode batch. Per adapted weight the bank keeps
// every slot's A and B stacked on the weight's device; build_lora_mm's hook
// (vendor patch 0109) adds each token's B[s] A[s] x, s its slot, one of three ways:
//   id:    GGML_OP_MUL_MAT_ID gathers each token's slot from a per-token index
//          input (the MoE op; the CPU's way);
//   dense: one product with every slot's A, a per-token one-hot mask over the
//          slots, one product with every slot's B (plain MUL_MAT and MUL, so
//          ggml-cuda keeps its CUDA graphs: its MUL_MAT_ID at a LoRA's rank
//          takes a path that synchronizes the stream and turns them off);
//   bgmv:  two ops per weight, as Punica's BGMV shrink and expand: u = A[s] x
//          (DREAM_CUSTOM_BANK_SHRINK), then y + B[s] u written as the weight's
//          output (DREAM_CUSTOM_BANK_EXPAND); CUDA kernels in cuda/custom-ops.cu,
//          CPU bodies here; each reads only its token's slot.
// DREAMSTAGE_BANK_GATHER picks; unset: id for weights on the host, bgmv on a GPU.
// Stack index 0 is all zero: the tokens on the base model gather it (id, bgmv)
// or mask every slot (dense).
#include "dream-stage.h"

#include "ggml-backend.h"
#include "llama-batch.h"
#include "llama-graph.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace {

// One adapted weight: every slot's factors, slot s at stack index s + 1.
struct bank_stack {
    bool dense = false;          // the dense layout and gather; else the id layout (id or bgmv)
    bool bgmv = false;
    ggml_tensor * a = nullptr;   // [n_in, max_rank, capacity + 1]
    ggml_tensor * b = nullptr;   // id: [max_rank, n_out, capacity + 1]; dense: [max_rank, capacity + 1, n_out];
                                 // each slot's scale folded in
    ggml_context_ptr ctx;
    ggml_backend_buffer_ptr buf;
};

} // namespace

struct dream_bank {
    llama_context * lctx = nullptr;
    const llama_model * model = nullptr;
    const llama_adapter_cvec * key = nullptr;   // the context's control-vector set: its lasting handle in graph builds
    int32_t capacity = 0;
    int32_t max_rank = 0;
    dream_bank_gather gather = DREAM_BANK_AUTO;
    std::unordered_map<const ggml_tensor *, std::unique_ptr<bank_stack>> stacks;   // by model weight
    std::vector<std::string> paths;        // [capacity]; "" = free slot
    uint64_t gen = 0;                      // bumps when a stack is added (the graph's topology changes)
    bool armed = false;                    // the next decodes add the bank's term
    std::vector<int32_t> token_stack;      // per batch token: stack index (0 = base)
    bool built_armed = false;              // the state serving's last graph was built with
    uint64_t built_gen = 0;
};

namespace {

// One bank per context, found by the context's control-vector set (dream_hook_bank_mm).
std::unordered_map<const llama_adapter_cvec *, dream_bank *> g_banks;

// The per-token slots of one serving graph, for the ubatch's tokens (`all`)
// and for the rows kept for output (`out`, the last layer's products): stack
// indices (id) and one-hot masks over the stacks (dense), each made when a
// product first needs it.
class bank_input : public llm_graph_input_i {
public:
    bank_input(dream_bank * bank, int64_t n_tokens) : bank(bank), gen(bank->gen), n_tokens(n_tokens) {}

    void set_input(const llama_ubatch * ub) override {
        const bool mapped = ub->data && ub->data->batch_idxs.size() == ub->n_tokens;
        std::vector<int32_t> all(ub->n_tokens), out;
        for (uint32_t i = 0; i < ub->n_tokens; ++i) {
            const int32_t bi = mapped ? ub->data->batch_idxs[i] : (int32_t) i;
            all[i] = bi >= 0 && bi < (int32_t) bank->token_stack.size() ? bank->token_stack[bi] : 0;
            if (ub->output[i]) {
                out.push_back(all[i]);
            }
        }
        for (int o = 0; o < 2; ++o) {
            std::vector<int32_t> & v = o ? out : all;
            if (ids[o]) {
                v.resize(ids[o]->ne[1], 0);
                ggml_backend_tensor_set(ids[o], v.data(), 0, v.size() * sizeof(int32_t));
            }
            if (mask[o]) {
                const int64_t n_stack = mask[o]->ne[1];
                std::vector<float> m(ggml_nelements(mask[o]), 0.0f);
                for (size_t t = 0; t < v.size() && t < (size_t) mask[o]->ne[2]; ++t) {
                    if (v[t] > 0) {
                        m[t * n_stack + v[t]] = 1.0f;
                    }
                }
                ggml_backend_tensor_set(mask[o], m.data(), 0, m.size() * sizeof(float));
            }
        }
    }

    // the graph holds the bank's term for the stacks of generation `gen`
    bool can_reuse(const llm_graph_params & params) override {
        return bank->armed && bank->gen == gen && n_tokens == (int64_t) params.ubatch.n_tokens;
    }

    // the slots of n_tok rows: indices [1, n_tok] (I32) or masks [1, n_stack, n_tok] (F32)
    ggml_tensor * get(ggml_context * ctx, int64_t n_tok, bool dense) {
        const int o = n_tok != n_tokens;
        ggml_tensor *& t = dense ? mask[o] : ids[o];
        if (!t) {
            t = dense ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, bank->capacity + 1, n_tok)
                      : ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n_tok);
            ggml_format_name(t, "dream_bank_%s%s", dense ? "mask" : "ids", o ? "_out" : "");
            ggml_set_input(t);
        }
        GGML_ASSERT(t->ne[dense ? 2 : 1] == n_tok);
        return t;
    }

    dream_bank * bank;
    uint64_t gen;
    int64_t n_tokens;
    ggml_tensor * ids[2] = { nullptr, nullptr };
    ggml_tensor * mask[2] = { nullptr, nullptr };
};

// After the bank's state changed: a graph built in another state is not reused.
void bank_sync_graph(dream_bank & bank) {
    if (bank.armed != bank.built_armed || (bank.armed && bank.gen != bank.built_gen)) {
        dream_context_access::forget_graph(*bank.lctx);
    }
}

void set_err(char * err, size_t n, const char * fmt, ...) {
    if (!err || n == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

// A tensor's values as F32 on the host, whatever its type and device.
std::vector<float> read_f32(const ggml_tensor * t) {
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::vector<float> out(ggml_nelements(t));
    if (t->type == GGML_TYPE_F32) {
        memcpy(out.data(), raw.data(), raw.size());
    } else {
        ggml_get_type_traits(t->type)->to_float(raw.data(), out.data(), (int64_t) out.size());
    }
    return out;
}

size_t slot_stride_a(const ggml_tensor * a) { return a->nb[2]; }

// DREAM_CUSTOM_BANK_SHRINK on the CPU: dst[:, t] = A[s] x[:, t], s = ids[t] (zeros for s = 0),
// from src x [n_in, n_tok], A [n_in, r, n], ids [1, n_tok]; dst [r, n_tok] (all contiguous).
void bank_shrink_cpu(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * x = dst->src[0], * a = dst->src[1], * ids = dst->src[2];
    const int64_t n_in = x->ne[0], n_tok = x->ne[1], r = a->ne[1];
    for (int64_t q = ith; q < r * n_tok; q += nth) {
        const int64_t t = q / r, k = q % r;
        const int32_t s = ((const int32_t *) ids->data)[t];
        double acc = 0.0;
        if (s != 0) {
            const float * xt = (const float *) x->data + t * n_in;
            const float * ak = (const float *) a->data + ((int64_t) s * r + k) * n_in;
            for (int64_t i = 0; i < n_in; ++i) {
                acc += (double) ak[i] * xt[i];
            }
        }
        ((float *) dst->data)[q] = (float) acc;
    }
}

// DREAM_CUSTOM_BANK_EXPAND on the CPU: dst[:, t] = y[:, t] + B[s] u[:, t], s = ids[t], from
// src y [n_out, n_tok], u [r, n_tok], B [r, n_out, n], ids [1, n_tok] (all contiguous).
// Thread ith computes its share of the outputs of every token.
void bank_expand_cpu(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * y = dst->src[0], * u = dst->src[1], * b = dst->src[2], * ids = dst->src[3];
    const int64_t n_out = y->ne[0], n_tok = y->ne[1], r = u->ne[0];
    const int64_t per = (n_out + nth - 1) / nth, j0 = std::min(n_out, ith * per), j1 = std::min(n_out, j0 + per);
    for (int64_t t = 0; t < n_tok; ++t) {
        const int32_t s = ((const int32_t *) ids->data)[t];
        const float * yt = (const float *) y->data + t * n_out;
        float * out = (float *) dst->data + t * n_out;
        const float * ut = (const float *) u->data + t * r;
        const float * bs = (const float *) b->data + (int64_t) s * r * n_out;
        for (int64_t j = j0; j < j1; ++j) {
            float acc = 0.0f;
            for (int64_t k = 0; s != 0 && k < r; ++k) {
                acc += bs[j * r + k] * ut[k];
            }
            out[j] = acc + yt[j];
        }
    }
}

// Bytes one slot's B takes.
size_t slot_bytes_b(const bank_stack & st) { return st.b->ne[0] * (st.dense ? st.b->ne[2] : st.b->ne[1]) * sizeof(float); }

// Writes stack index k's B from bp ([max_rank, n_out]; NULL: zeros).
void write_slot_b(bank_stack & st, int64_t k, const float * bp) {
    const int64_t r = st.b->ne[0];
    if (!st.dense) {
        const size_t sb = st.b->nb[2];
        if (bp) {
            ggml_backend_tensor_set(st.b, bp, k * sb, sb);
        } else {
            ggml_backend_tensor_memset(st.b, 0, k * sb, sb);
        }
        return;
    }
    // dense: slot k's rank-row r of output j sits at (j, k): one read-modify-write of the stack
    std::vector<float> all(ggml_nelements(st.b));
    ggml_backend_tensor_get(st.b, all.data(), 0, ggml_nbytes(st.b));
    const int64_t n_stack = st.b->ne[1], n_out = st.b->ne[2];
    for (int64_t j = 0; j < n_out; ++j) {
        float * dst = all.data() + (j * n_stack + k) * r;
        for (int64_t q = 0; q < r; ++q) {
            dst[q] = bp ? bp[j * r + q] : 0.0f;
        }
    }
    ggml_backend_tensor_set(st.b, all.data(), 0, ggml_nbytes(st.b));
}

} // namespace

ggml_tensor * dream_hook_bank_mm(ggml_context * ctx, llm_graph_result * res, const llama_adapter_cvec * cvec, bool training,
                                 int64_t n_tokens, const ggml_tensor * w, ggml_tensor * x, ggml_tensor * y) {
    if (training || g_banks.empty()) {
        return y;
    }
    auto it = g_banks.find(cvec);
    if (it == g_banks.end()) {
        return y;
    }
    dream_bank & bank = *it->second;
    bank.built_armed = bank.armed;
    bank.built_gen = bank.gen;
    if (!bank.armed) {
        return y;
    }
    auto st = bank.stacks.find(w);
    if (st == bank.stacks.end()) {
        return y;
    }
    const int64_t n_in = w->ne[0];
    const int64_t n_tok = ggml_nelements(x) / n_in;
    GGML_ASSERT(x->ne[0] == n_in && ggml_nelements(y) == w->ne[1] * n_tok);

    bank_input * inp = nullptr;
    for (auto & i : res->inputs) {
        if ((inp = dynamic_cast<bank_input *>(i.get()))) {
            break;
        }
    }
    if (!inp) {
        inp = static_cast<bank_input *>(res->add_input(std::make_unique<bank_input>(&bank, n_tokens)));
    }
    const bank_stack & s = *st->second;
    const int64_t r = bank.max_rank, n_stack = bank.capacity + 1, n_out = w->ne[1];
    ggml_tensor * xc = ggml_is_contiguous(x) ? x : ggml_cont(ctx, x);
    ggml_tensor * term;
    if (s.dense) {
        ggml_tensor * mask = inp->get(ctx, n_tok, true);                                       // [1, n_stack, n_tok]
        ggml_tensor * ax = ggml_mul_mat(ctx, ggml_reshape_2d(ctx, s.a, n_in, r * n_stack),
                                        ggml_reshape_2d(ctx, xc, n_in, n_tok));                  // [r * n_stack, n_tok]
        ax = ggml_mul(ctx, ggml_reshape_3d(ctx, ax, r, n_stack, n_tok), mask);                   // other slots zeroed
        term = ggml_mul_mat(ctx, ggml_reshape_2d(ctx, s.b, r * n_stack, n_out),
                            ggml_reshape_2d(ctx, ax, r * n_stack, n_tok));                       // [n_out, n_tok]
    } else if (s.bgmv) {
        // shrink then expand, the expand adding onto the weight's output: no separate ADD
        ggml_tensor * ids = inp->get(ctx, n_tok, false);
        ggml_tensor * in[3] = { ggml_reshape_2d(ctx, xc, n_in, n_tok), s.a, ids };
        ggml_tensor * u = dream_custom_tagged(ggml_custom_4d(ctx, GGML_TYPE_F32, r, n_tok, 1, 1, in, 3, bank_shrink_cpu,
                                                             GGML_N_TASKS_MAX, nullptr), DREAM_CUSTOM_BANK_SHRINK);
        ggml_tensor * yc = ggml_is_contiguous(y) ? y : ggml_cont(ctx, y);
        ggml_tensor * out[4] = { ggml_reshape_2d(ctx, yc, n_out, n_tok), u, s.b, ids };
        ggml_tensor * sum = dream_custom_tagged(ggml_custom_4d(ctx, GGML_TYPE_F32, n_out, n_tok, 1, 1, out, 4,
                                                               bank_expand_cpu, GGML_N_TASKS_MAX, nullptr),
                                                DREAM_CUSTOM_BANK_EXPAND);
        return ggml_reshape(ctx, sum, y);
    } else {
        ggml_tensor * ids = inp->get(ctx, n_tok, false);                                       // [1, n_tok]
        ggml_tensor * ax = ggml_mul_mat_id(ctx, s.a, ggml_reshape_3d(ctx, xc, n_in, 1, n_tok), ids);   // [r, 1, n_tok]
        term = ggml_mul_mat_id(ctx, s.b, ax, ids);                                             // [n_out, 1, n_tok]
    }
    // the term first, as patch 0103 orders the context's own adapters
    return ggml_add(ctx, ggml_reshape(ctx, term, y), y);
}

dream_bank * dream_bank_init(llama_context * ctx, int32_t capacity, int32_t max_rank, char * err, size_t err_size) {
    if (!ctx) {
        set_err(err, err_size, "no context");
        return nullptr;
    }
    if (capacity < 1 || capacity > 1024) {
        set_err(err, err_size, "capacity %d is out of range (1..1024)", capacity);
        return nullptr;
    }
    if (max_rank < 1 || max_rank > 4096) {
        set_err(err, err_size, "max_rank %d is out of range (1..4096)", max_rank);
        return nullptr;
    }
    const llama_adapter_cvec * key = dream_context_access::cvec(*ctx);
    if (g_banks.count(key)) {
        set_err(err, err_size, "this context already has an adapter bank");
        return nullptr;
    }
    auto * bank = new dream_bank();
    bank->lctx = ctx;
    bank->model = &ctx->get_model();
    bank->key = key;
    bank->capacity = capacity;
    bank->max_rank = max_rank;
    bank->gather = dream_switches_read().bank_gather;
    bank->paths.assign(capacity, "");
    g_banks[key] = bank;
    return bank;
}

void dream_bank_free(dream_bank * bank) {
    if (!bank) {
        return;
    }
    if (bank->built_armed) {            // serving's last graph reads the stacks freed below
        dream_context_access::forget_graph(*bank->lctx);
    }
    g_banks.erase(bank->key);
    delete bank;
}

namespace {

using adapter_ptr = std::unique_ptr<llama_adapter_lora, void (*)(llama_adapter_lora *)>;

// one weight the adapter adapts: the model's tensor and the adapter's A and B for it
struct bank_pending { const ggml_tensor * w; const llama_adapter_lora_weight * lw; };

// Reads path with llama.cpp's own loader (it checks the format, the architecture
// and every shape) and checks that the bank can hold it: each weight the
// model's, of rank up to max_rank. Null with err set when not.
adapter_ptr bank_read_adapter(const dream_bank & bank, const char * path, std::vector<bank_pending> & todo,
                              char * err, size_t err_size) {
    adapter_ptr ad(llama_adapter_lora_init(const_cast<llama_model *>(bank.model), path), llama_adapter_lora_free);
    if (!ad) {
        set_err(err, err_size, "%s: llama.cpp refused it as a LoRA adapter for this model "
                "(not a GGUF LoRA, another architecture, or shapes that do not match its weights)", path);
        return adapter_ptr(nullptr, llama_adapter_lora_free);
    }
    const char * refusal = !ad->alora_invocation_tokens.empty() ? "an activated LoRA (aLoRA) cannot be banked"
                         : ad->ab_map.empty()                   ? "the adapter adapts no weight"
                                                                : nullptr;
    if (refusal) {
        set_err(err, err_size, "%s: %s", path, refusal);
        return adapter_ptr(nullptr, llama_adapter_lora_free);
    }
    for (const auto & [name, lw] : ad->ab_map) {
        const ggml_tensor * w = bank.model->get_tensor(name.c_str());
        if (!w || lw.a->ne[0] != w->ne[0] || lw.b->ne[1] != w->ne[1] || lw.a->ne[1] != lw.b->ne[0]) {
            set_err(err, err_size, "%s: %s does not match the model's weight", path, name.c_str());
            return adapter_ptr(nullptr, llama_adapter_lora_free);
        }
        if (lw.a->ne[1] > bank.max_rank) {
            set_err(err, err_size, "%s: %s has rank %lld, above the bank's max_rank %d", path, name.c_str(),
                    (long long) lw.a->ne[1], bank.max_rank);
            return adapter_ptr(nullptr, llama_adapter_lora_free);
        }
        todo.push_back({w, &lw});
    }
    return ad;
}

// Allocates the stacks the adapter needs and the bank lacks, all of them before
// the bank changes; false (err set, the bank as it was) when one does not fit.
bool bank_add_stacks(dream_bank & bank, const std::vector<bank_pending> & todo, const char * path, char * err,
                     size_t err_size) {
    std::vector<std::pair<const ggml_tensor *, std::unique_ptr<bank_stack>>> fresh;
    for (const auto & p : todo) {
        if (bank.stacks.count(p.w)) {
            continue;
        }
        auto st = std::make_unique<bank_stack>();
        ggml_init_params ip = { 2 * ggml_tensor_overhead(), nullptr, true };
        st->ctx.reset(ggml_init(ip));
        const int64_t n = bank.capacity + 1;
        ggml_backend_buffer_type_t buft = dream_lora_buft(p.w);
        const bool host = ggml_backend_buft_is_host(buft);
        st->dense = bank.gather == DREAM_BANK_DENSE;
        st->bgmv = bank.gather == DREAM_BANK_BGMV || (bank.gather == DREAM_BANK_AUTO && !host);
        st->a = ggml_new_tensor_3d(st->ctx.get(), GGML_TYPE_F32, p.w->ne[0], bank.max_rank, n);
        st->b = st->dense ? ggml_new_tensor_3d(st->ctx.get(), GGML_TYPE_F32, bank.max_rank, n, p.w->ne[1])
                          : ggml_new_tensor_3d(st->ctx.get(), GGML_TYPE_F32, bank.max_rank, p.w->ne[1], n);
        ggml_format_name(st->a, "%s.bank_a", p.w->name);
        ggml_format_name(st->b, "%s.bank_b", p.w->name);
        st->buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(st->ctx.get(), buft));
        if (!st->buf) {
            set_err(err, err_size, "%s: could not allocate the bank's stack for %s in %s", path, p.w->name,
                    ggml_backend_buft_name(buft));
            return false;
        }
        ggml_backend_buffer_clear(st->buf.get(), 0);
        fresh.emplace_back(p.w, std::move(st));
    }
    for (auto & [w, st] : fresh) {
        bank.stacks[w] = std::move(st);
    }
    if (!fresh.empty()) {
        bank.gen++;
    }
    return true;
}

// Writes the adapter's A and scaled B into stack slot `slot + 1` of each weight
// (slot 0 of every stack stays zero: the tokens without an adapter).
void bank_place(dream_bank & bank, const llama_adapter_lora & ad, const std::vector<bank_pending> & todo,
                int32_t slot, float scale) {
    const int64_t r_max = bank.max_rank;
    for (const auto & p : todo) {
        bank_stack & st = *bank.stacks[p.w];
        const int64_t n_out = p.w->ne[1], r = p.lw->a->ne[1];
        const float s = p.lw->get_scale(ad.alpha, scale);
        std::vector<float> a = read_f32(p.lw->a);                   // [n_in, r]: the slot's first r rows
        std::vector<float> b = read_f32(p.lw->b);                   // [r, n_out]
        std::vector<float> bp((size_t) (r_max * n_out), 0.0f);      // [r_max, n_out], scaled
        for (int64_t j = 0; j < n_out; ++j) {
            for (int64_t k = 0; k < r; ++k) {
                bp[j * r_max + k] = b[j * r + k] * s;
            }
        }
        const size_t sa = slot_stride_a(st.a);
        ggml_backend_tensor_memset(st.a, 0, (slot + 1) * sa, sa);
        ggml_backend_tensor_set(st.a, a.data(), (slot + 1) * sa, a.size() * sizeof(float));
        write_slot_b(st, slot + 1, bp.data());
    }
}

}  // namespace

int32_t dream_bank_load(dream_bank * bank, const char * path, float scale, char * err, size_t err_size) {
    const auto free_slot = std::find(bank->paths.begin(), bank->paths.end(), std::string());
    if (free_slot == bank->paths.end()) {
        set_err(err, err_size, "%s: the adapter bank is full (capacity %d): unload one first", path, bank->capacity);
        return -1;
    }
    const int32_t slot = (int32_t) (free_slot - bank->paths.begin());
    if (!std::isfinite(scale)) {
        set_err(err, err_size, "%s: scale %g is not finite", path, (double) scale);
        return -1;
    }
    std::vector<bank_pending> todo;
    adapter_ptr ad = bank_read_adapter(*bank, path, todo, err, err_size);
    if (!ad || !bank_add_stacks(*bank, todo, path, err, err_size)) {
        return -1;
    }
    bank_place(*bank, *ad, todo, slot, scale);
    bank->paths[slot] = path;
    bank_sync_graph(*bank);
    return slot;
}

bool dream_bank_unload(dream_bank * bank, int32_t slot) {
    if (slot < 0 || slot >= bank->capacity || bank->paths[slot].empty()) {
        return false;
    }
    for (auto & [w, st] : bank->stacks) {
        const size_t sa = slot_stride_a(st->a);
        ggml_backend_tensor_memset(st->a, 0, (slot + 1) * sa, sa);
        write_slot_b(*st, slot + 1, nullptr);
    }
    for (auto & t : bank->token_stack) {
        if (t == slot + 1) {
            t = 0;
        }
    }
    bank->paths[slot].clear();
    return true;
}

bool dream_bank_set_token_adapters(dream_bank * bank, const int32_t * slots, int32_t n, char * err, size_t err_size) {
    if (n < 0 || (n > 0 && !slots)) {
        set_err(err, err_size, "token count %d without slots", n);
        return false;
    }
    bool any = false;
    for (int32_t i = 0; i < n; ++i) {
        const int32_t s = slots[i];
        if (s < -1 || s >= bank->capacity || (s >= 0 && bank->paths[s].empty())) {
            set_err(err, err_size, "token %d: slot %d holds no adapter (loaded slots are 0..%d, -1 is the base)", i, s,
                    bank->capacity - 1);
            return false;
        }
        any = any || s >= 0;
    }
    bank->armed = any;
    bank->token_stack.resize(any ? n : 0);
    for (int32_t i = 0; any && i < n; ++i) {
        bank->token_stack[i] = slots[i] + 1;
    }
    bank_sync_graph(*bank);
    return true;
}

size_t dream_bank_slot_bytes(const dream_bank * bank, int32_t slot) {
    if (slot < 0 || slot >= bank->capacity || bank->paths[slot].empty()) {
        return 0;
    }
    size_t n = 0;
    for (const auto & [w, st] : bank->stacks) {
        n += slot_stride_a(st->a) + slot_bytes_b(*st);
    }
    return n;
}

size_t dream_bank_total_bytes(const dream_bank * bank) {
    size_t n = 0;
    for (const auto & [w, st] : bank->stacks) {
        n += ggml_backend_buffer_get_size(st->buf.get());
    }
    return n;
}
