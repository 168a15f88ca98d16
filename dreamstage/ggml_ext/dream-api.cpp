// dream.h's C functions: validation, then thin calls into the concern files.
#include "dream-stage.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

extern "C" {

struct dream_params dream_default_params(void) {
    dream_params p{};
    p.rank = 8;
    p.alpha = 16.0f;
    p.targets = "attn_q,attn_v";
    p.top_layers = 0;
    p.seed = 0;
    p.context_cache_type = "q8_0";
    p.window = 512;
    p.chunk = 128;
    p.exact = false;
    p.recompute = false;
    p.horizon = -1;
    p.lr = 1e-4f;
    p.beta1 = 0.9f;
    p.beta2 = 0.999f;
    p.eps = 1e-8f;
    p.weight_decay = 0.0f;
    p.grad_clip = 1.0f;
    p.accumulate_windows = 1;
    p.memory_budget_mib = 0.0;
    p.slack_mib = 64.0;
    return p;
}

}

// A bad value names itself; nothing is allocated before this passes.
static bool dream_validate(dream_stage & ds, std::string & err) {
    const dream_params & p = ds.params;
    char buf[256];
    auto bad = [&](const char * fmt, auto v) {
        std::snprintf(buf, sizeof(buf), fmt, v);
        err = buf;
        return false;
    };
    if (!dream_cache_type_from_name(p.context_cache_type, ds.cache_type)) {
        std::snprintf(buf, sizeof(buf), "context_cache_type '%s' is not one of %s",
                      p.context_cache_type ? p.context_cache_type : "(null)", dream_context_cache_types());
        err = buf;
        return false;
    }
    if (p.rank <= 0) return bad("rank must be positive, got %d", p.rank);
    if (!(p.alpha > 0) || !std::isfinite(p.alpha)) return bad("alpha must be positive, got %g", (double) p.alpha);
    if (p.window <= 0) return bad("window must be positive, got %d", p.window);
    if (p.chunk <= 0 || p.chunk > p.window) return bad("chunk must be in 1..window, got %d", p.chunk);
    if (!p.exact && p.horizon > 0) return bad("horizon=%d applies to the exact walk only (exact=false)", p.horizon);
    if (!(p.lr >= 0) || !std::isfinite(p.lr)) return bad("lr must be >= 0, got %g", (double) p.lr);
    if (!(p.beta1 >= 0 && p.beta1 < 1)) return bad("beta1 must be in [0, 1), got %g", (double) p.beta1);
    if (!(p.beta2 >= 0 && p.beta2 < 1)) return bad("beta2 must be in [0, 1), got %g", (double) p.beta2);
    if (!(p.eps > 0)) return bad("eps must be positive, got %g", (double) p.eps);
    if (!(p.weight_decay >= 0)) return bad("weight_decay must be >= 0, got %g", (double) p.weight_decay);
    if (std::isnan(p.grad_clip)) return bad("grad_clip must be a number, got %g", (double) p.grad_clip);
    if (!(p.slack_mib >= 0)) return bad("slack_mib must be >= 0, got %g", p.slack_mib);
    if (p.accumulate_windows < 1) return bad("accumulate_windows must be >= 1, got %d", p.accumulate_windows);
    if (p.window > (int32_t) ds.lctx->n_ctx() * 64) return bad("window %d is implausibly large", p.window);
    return true;
}

extern "C" {

struct dream_stage * dream_init(struct llama_context * ctx, struct dream_params params, struct dream_receipt * receipt) {
    dream_receipt tmp;
    dream_receipt & r = receipt ? *receipt : tmp;
    auto ds = std::make_unique<dream_stage>();
    ds->lctx = ctx;
    ds->model = const_cast<llama_model *>(&ctx->get_model());
    ds->params = params;
    ds->switches = dream_switches_read();   // the stage's one read of the environment
    ds->targets_str = params.targets ? params.targets : "";
    ds->cache_type_str = params.context_cache_type ? params.context_cache_type : "";
    // keep copies: the caller's strings may die after this call
    ds->params.targets = ds->targets_str.c_str();
    ds->params.context_cache_type = ds->cache_type_str.c_str();
    dream_receipt_start(*ds, r);
    r.chunk_tokens = 0;

    std::string err;
    if (!dream_validate(*ds, err) || !dream_plan(*ds, err)) {
        r.status = DREAM_STATUS_ERROR;
        dream_receipt_message(r, "%s", err.c_str());
        return nullptr;
    }
    ds->mem.horizon = params.exact && params.horizon > 0 ? params.horizon : 0;
    ds->mem.chunk_max = params.chunk;
    // gate the job's standing memory before anything exists
    const size_t cache_bytes = dream_memory_bytes_planned(*ds);
    const size_t adapter_bytes = dream_adapter_bytes_planned(*ds);
    std::vector<std::pair<ggml_backend_dev_t, size_t>> needs;
    for (auto & pr : ds->lora.pairs) {
        // where the pair will live (dream_lora_buft)
        needs.push_back({ dream_buft_device(dream_lora_buft(pr.weight)),
                          2 * (size_t) ds->params.rank * (pr.n_in + pr.n_out) * sizeof(float) });
    }
    // the cache lives with the layers; on one device it is all here
    for (uint32_t il = 0; il < ds->model->hparams.n_layer(); ++il) {
        if (!ds->model->hparams.has_kv(il)) {
            continue;
        }
        const size_t per_layer = (ggml_row_size(ds->cache_type, ds->model->hparams.n_embd_k_gqa(il)) +
                                  ggml_row_size(ds->cache_type, ds->model->hparams.n_embd_v_gqa(il))) * (size_t) ds->params.window;
        needs.push_back({ ds->model->dev_layer(il), per_layer });
    }
    const dream_gate_verdict v = dream_gate_check(*ds, needs);
    r.context_mib = (double) cache_bytes / DREAM_MIB;
    r.adapter_mib = (double) adapter_bytes / DREAM_MIB;
    if (!v.fits) {
        r.status = DREAM_STATUS_REFUSED;
        dream_receipt_refused(r, -1, 0, v);
        dream_receipt_message(r, "the job's training cache (%.2f MiB, %s, %d tokens) and adapters (%.2f MiB) need %.2f MiB on %s; "
                              "allowance %.2f MiB%s", r.context_mib, ds->cache_type_str.c_str(), ds->params.window,
                              r.adapter_mib, v.need_mib, v.device.c_str(), v.allowance_mib, v.why.c_str());
        return nullptr;
    }
    if (!dream_adapter_create(*ds, err) || !dream_memory_create(*ds, err)) {
        r.status = DREAM_STATUS_ERROR;
        dream_receipt_message(r, "%s", err.c_str());
        return nullptr;
    }
    ds->fused_attn = dream_fattn_usable(*ds);
    dream_opt_choose(*ds);
    dream_receipt_start(*ds, r);
    return ds.release();
}

void dream_free(struct dream_stage * ds) {
    if (!ds) {
        return;
    }
    dream_context_access::detach_lora(*ds->lctx, ds->lora.served.get());
    dream_context_access::detach_lora(*ds->lctx, ds->lora.shadow.get());
    delete ds;
}

int32_t dream_window_begin(struct dream_stage * ds, const llama_token * tokens, const uint8_t * loss_mask, int32_t n,
                           struct dream_receipt * receipt) {
    dream_receipt tmp;
    dream_receipt & r = receipt ? *receipt : tmp;
    dream_receipt_start(*ds, r);
    if (n < 2 || n > ds->params.window || !tokens || !loss_mask) {
        r.status = DREAM_STATUS_ERROR;
        dream_receipt_message(r, "a window needs 2..%d tokens and a loss mask, got %d", ds->params.window, n);
        return r.status;
    }
    const int32_t n_vocab = ds->model->vocab.n_tokens();
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            r.status = DREAM_STATUS_ERROR;
            dream_receipt_message(r, "token %d at position %d is outside the vocabulary (%d)", tokens[i], i, n_vocab);
            return r.status;
        }
    }
    dream_suspended_drop(*ds);         // a stopped step of the last window is not continued
    ds->group = dream_group_state{};   // a plain window ends any group (dream-groups.cpp)
    ds->win.loss_scale = 1.0f;
    dream_soft_clear(*ds);             // one-hot labels unless dream_window_soft_targets follows
    ds->win.tokens.assign(tokens, tokens + n);
    ds->win.mask.assign(loss_mask, loss_mask + n);
    ds->win.mask[0] = 0;
    ds->win.n_masked = 0;
    for (int32_t i = 1; i < n; ++i) {
        ds->win.n_masked += ds->win.mask[i] ? 1 : 0;
    }
    ds->win.n = n;
    ds->win.pos = 0;
    ds->win.active = true;
    ds->mem.cache->clear(false);
    // the exact walk: the last loss token is predicted from inputs [0, j)
    ds->win.loss_end = 0;
    for (int32_t j = 1; j < n; ++j) {
        if (ds->win.mask[j]) {
            ds->win.loss_end = j;
        }
    }
    ds->win.reverse = false;
    ds->win.rev_end = 0;
    ds->win.adj.assign(ds->params.exact ? n : 0, 0);
    dream_walk_clear(*ds);
    // a fresh gradient for every optimizer step
    if (ds->opt.windows_pending == 0) {
        dream_opt_zero_acc(*ds);
    }
    r.chunk_pos = 0;
    return DREAM_STATUS_OK;
}

int32_t dream_micro_step(struct dream_stage * ds, struct dream_receipt * receipt) {
    dream_receipt tmp;
    dream_receipt & r = receipt ? *receipt : tmp;
    const uint64_t bytes0 = dream_rpc_bytes(), failures0 = dream_rpc_failures();
    int32_t status = dream_walk_micro_step(*ds, r);
    r.rpc_bytes = (int64_t) (dream_rpc_bytes() - bytes0);
    std::string worker;
    if (dream_rpc_failures(&worker) != failures0) {
        // a worker died during the step: whatever it computed is lost, the step failed
        r.status = status = DREAM_STATUS_ERROR;
        dream_receipt_message(r, "the RPC worker at %s failed during the micro-step; its layers, adapters and "
                              "cache are gone until it is restarted and the model reloaded", worker.c_str());
    }
    return status;
}

int32_t dream_chunks_left(const struct dream_stage * ds) {
    return dream_walk_chunks_left(*ds);
}

int64_t dream_n_params(const struct dream_stage * ds) {
    return ds->lora.n_params;
}

int32_t dream_n_pairs(const struct dream_stage * ds) {
    return (int32_t) ds->lora.pairs.size();
}

bool dream_pair_info(const struct dream_stage * ds, int32_t i, int32_t * layer, const char ** target, int64_t * n_in,
                     int64_t * n_out) {
    if (i < 0 || i >= (int32_t) ds->lora.pairs.size()) {
        return false;
    }
    const dream_pair & p = ds->lora.pairs[i];
    *layer = p.layer;
    *target = dream_target_names[p.target];
    *n_in = p.n_in;
    *n_out = p.n_out;
    return true;
}

bool dream_gradients(const struct dream_stage * ds, float * out, int64_t n) {
    if (n < ds->lora.n_params) {
        return false;
    }
    dream_opt_read(*ds, 0, out);
    return true;
}

bool dream_get_parameters(const struct dream_stage * ds, float * out, int64_t n) {
    return n >= ds->lora.n_params && dream_adapter_read(*ds, true, out);
}

bool dream_set_parameters(struct dream_stage * ds, const float * in, int64_t n) {
    if (n != ds->lora.n_params) {
        return false;
    }
    dream_suspended_drop(*ds);   // a stopped step computed its first part with the old values
    dream_adapter_write(*ds, in);
    return true;
}

int64_t dream_optimizer_state(const struct dream_stage * ds, float * out, int64_t n) {
    if (n < 2 * ds->lora.n_params) {
        return -1;
    }
    dream_opt_read(*ds, 1, out);
    dream_opt_read(*ds, 2, out + ds->lora.n_params);
    return ds->opt.adam_t;
}

bool dream_set_optimizer_state(struct dream_stage * ds, const float * in, int64_t n, int64_t t) {
    if (n != 2 * ds->lora.n_params || t < 0 || ds->opt.windows_pending > 0) {
        return false;
    }
    if (!dream_opt_ready(*ds) && !dream_opt_create(*ds)) {
        return false;
    }
    dream_opt_zero_acc(*ds);
    dream_opt_write(*ds, 1, in);
    dream_opt_write(*ds, 2, in + ds->lora.n_params);
    ds->opt.adam_t = t;
    return true;
}

int64_t dream_promote(struct dream_stage * ds) {
    dream_adapter_copy(*ds, true);
    return ++ds->lora.served_version;
}

struct llama_adapter_lora * dream_served_adapter(struct dream_stage * ds) {
    return ds->lora.served.get();
}

void dream_set_budget(struct dream_stage * ds, double memory_budget_mib) {
    ds->params.memory_budget_mib = memory_budget_mib;
}

int32_t dream_set_horizon(struct dream_stage * ds, int32_t horizon) {
    if (!ds->params.exact) {
        return -1;
    }
    dream_suspended_drop(*ds);
    ds->mem.horizon = horizon > 0 ? horizon : 0;
    // adjoint buffers already sized for a shorter horizon bound it
    if (ds->mem.adj_rows > 0 && ds->mem.adj_rows < ds->params.window &&
        (ds->mem.horizon == 0 || ds->mem.horizon + ds->params.chunk > ds->mem.adj_rows)) {
        ds->mem.horizon = std::max(1, ds->mem.adj_rows - ds->params.chunk);
    }
    return ds->mem.horizon;
}

bool dream_set_chunk(struct dream_stage * ds, int32_t chunk) {
    // Graphs are built per micro-step from params.chunk, and nothing is sized by
    // it at init (the training cache is sized by the window), so a new value
    // takes effect at the next chunk.
    if (chunk <= 0 || chunk > ds->params.window) {
        return false;
    }
    if (chunk != ds->params.chunk) {
        dream_suspended_drop(*ds);   // a stopped step is not continued with another chunk
    }
    ds->params.chunk = chunk;
    ds->mem.chunk_max = std::max(ds->mem.chunk_max, chunk);
    return true;
}

bool dream_set_lr(struct dream_stage * ds, float lr) {
    // both updates (host and device) read params.lr at each update
    if (!ds || !(lr >= 0) || !std::isfinite(lr)) {
        return false;
    }
    ds->params.lr = lr;
    return true;
}

int32_t dream_last_n_splits(const struct dream_stage * ds) {
    return ds ? ds->exec.last_n_splits : 0;
}

bool dream_last_step_stoppable(const struct dream_stage * ds) {
    return ds && ds->exec.last_step_stoppable;
}

void dream_set_graph_reuse(struct dream_stage * ds, bool on) {
    if (!ds) {
        return;
    }
    ds->exec.graph_reuse = on;
    if (!on) {
        dream_suspended_drop(*ds);
        dream_step_graph_drop(*ds);   // the allocation stays the scheduler's until the next step resets it
    }
}

int64_t dream_graph_reuses(const struct dream_stage * ds) {
    return ds ? ds->exec.graph_reuses : 0;
}

bool dream_fused_attention(const struct dream_stage * ds) {
    return ds && ds->fused_attn;
}

bool dream_optimizer_on_device(const struct dream_stage * ds) {
    return ds && dream_opt_on_device(*ds);
}

void dream_set_step_deadline(struct dream_stage * ds, double ms) {
    if (ds) {
        ds->exec.step_deadline_ms = ms > 0 ? ms : 0;   // NaN too: no deadline
    }
}

void dream_set_step_abort(struct dream_stage * ds, double ms) {
    if (ds) {
        ds->exec.step_abort_ms = ms > 0 ? ms : 0;   // NaN too: no limit
    }
}

size_t dream_serving_compute_bytes(struct llama_context * ctx) {
    ggml_backend_sched_t s = ctx->get_sched();
    size_t total = 0;
    for (int b = 0; b < ggml_backend_sched_get_n_backends(s); ++b) {
        total += ggml_backend_sched_get_buffer_size(s, ggml_backend_sched_get_backend(s, b));
    }
    return total;
}

}
