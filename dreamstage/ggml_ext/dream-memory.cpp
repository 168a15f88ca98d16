// Training memory: a second llama_kv_cache on the resident model, owned by the
// dream stage, sized to the job's window and stored in context_cache_type. It
// holds constants only (the K/V of the window before the current chunk).
#include "dream-stage.h"

#include <cstring>
#include <map>
#include <string>

#include "ggml-backend.h"

// The one list of training cache types: parsing, the error message and
// dream_context_cache_types() all read it, and Python reads the last.
static const struct { const char * name; ggml_type type; } k_cache_types[] = {
    { "q8_0", GGML_TYPE_Q8_0 }, { "q4_0", GGML_TYPE_Q4_0 }, { "f16", GGML_TYPE_F16 }, { "f32", GGML_TYPE_F32 },
};

extern "C" const char * dream_context_cache_types(void) {
    static const std::string joined = [] {
        std::string s;
        for (const auto & k : k_cache_types) {
            s += (s.empty() ? "" : ",");
            s += k.name;
        }
        return s;
    }();
    return joined.c_str();
}

bool dream_cache_type_from_name(const char * name, ggml_type & out) {
    if (!name) {
        return false;
    }
    for (const auto & k : k_cache_types) {
        if (std::strcmp(name, k.name) == 0) {
            out = k.type;
            return true;
        }
    }
    return false;
}

// Bytes the cache's K and V tensors will occupy, from the same row sizes the
// cache allocates with; used by the gate before anything exists.
size_t dream_memory_bytes_planned(const dream_stage & ds) {
    const auto & hp = ds.model->hparams;
    size_t total = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.has_kv(il)) {
            continue;
        }
        total += ggml_row_size(ds.cache_type, hp.n_embd_k_gqa(il)) * (size_t) ds.params.window;
        total += ggml_row_size(ds.cache_type, hp.n_embd_v_gqa(il)) * (size_t) ds.params.window;
    }
    return total;
}

bool dream_memory_create(dream_stage & ds, std::string & err) {
    const auto & hp = ds.model->hparams;
    if (hp.swa_type != LLAMA_SWA_TYPE_NONE) {
        err = "models with sliding-window attention are not supported by the dream stage yet";
        return false;
    }
    try {
        // V is stored untransposed (v_trans = false): the attention hook joins the
        // cached prefix and the chunk's own V along the cell axis, as for K.
        ds.mem.cache.reset(new llama_kv_cache(*ds.model, hp, ds.cache_type, ds.cache_type,
                /*v_trans*/ false, /*offload*/ true, /*unified*/ true, (uint32_t) ds.params.window,
                /*n_seq_max*/ 1, /*n_pad*/ 1, /*n_swa*/ 0, LLAMA_SWA_TYPE_NONE,
                /*mem_other*/ nullptr, nullptr, nullptr, nullptr, "dream"));
    } catch (const std::exception & e) {
        err = std::string("could not create the training cache: ") + e.what();
        ds.mem.cache.reset();
        return false;
    }
    ds.mem.context_bytes = 0;
    for (const auto & [buft, size] : ds.mem.cache->memory_breakdown()) {
        ds.mem.context_bytes += size;
    }
    return true;
}

// The exact walk's adjoint buffers gK, gV: F32, one row per slot, like the
// cache's own rows. Position q's adjoint lives in slot q % rows: with a
// horizon H the reverse pass only ever holds adjoints for the H positions
// before its chunk and the chunk itself, so rows = min(window, H + chunk),
// and the whole window without one. Allocated at the first backward chunk,
// through the gate (dream-step.cpp); the plain walk has none.
std::vector<std::pair<ggml_backend_dev_t, size_t>> dream_walk_bytes_planned(const dream_stage & ds, int32_t rows) {
    std::vector<std::pair<ggml_backend_dev_t, size_t>> out;
    const auto & hp = ds.model->hparams;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (hp.has_kv(il)) {
            out.push_back({ ds.model->dev_layer(il), (ggml_row_size(GGML_TYPE_F32, hp.n_embd_k_gqa(il)) +
                                                      ggml_row_size(GGML_TYPE_F32, hp.n_embd_v_gqa(il))) * (size_t) rows });
        }
    }
    return out;
}

bool dream_walk_create(dream_stage & ds, int32_t rows, std::string & err) {
    dream_walk_free(ds);
    const auto & hp = ds.model->hparams;
    ds.mem.adj_k.assign(hp.n_layer(), nullptr);
    ds.mem.adj_v.assign(hp.n_layer(), nullptr);
    // one context and buffer per buffer type, as the cache places its layers
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        if (!hp.has_kv(il)) {
            continue;
        }
        ggml_backend_dev_t dev = ds.model->dev_layer(il);
        ggml_backend_buffer_type_t buft = dev ? ggml_backend_dev_buffer_type(dev) : ggml_backend_cpu_buffer_type();
        ggml_context *& ctx = ctx_of[buft];
        if (!ctx) {
            ggml_init_params ip = { 2 * hp.n_layer() * ggml_tensor_overhead(), nullptr, true };
            ds.mem.adj_ctxs.emplace_back(ggml_init(ip));
            ctx = ds.mem.adj_ctxs.back().get();
        }
        ds.mem.adj_k[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hp.n_embd_head_k(il), hp.n_head_kv(il), rows);
        ds.mem.adj_v[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, hp.n_embd_head_v(il), hp.n_head_kv(il), rows);
        ggml_format_name(ds.mem.adj_k[il], "dream_adj_k-%u", il);
        ggml_format_name(ds.mem.adj_v[il], "dream_adj_v-%u", il);
    }
    for (const auto & [buft, ctx] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (!buf) {
            err = std::string("could not allocate the exact walk's adjoint buffers on ") + ggml_backend_buft_name(buft);
            dream_walk_free(ds);
            return false;
        }
        ds.mem.adj_bufs.emplace_back(buf);
        ds.mem.walk_bytes += ggml_backend_buffer_get_size(buf);
    }
    ds.mem.adj_rows = rows;
    dream_walk_clear(ds);
    return true;
}

void dream_walk_free(dream_stage & ds) {
    ds.mem.adj_k.clear();
    ds.mem.adj_v.clear();
    ds.mem.adj_bufs.clear();
    ds.mem.adj_ctxs.clear();
    ds.mem.walk_bytes = 0;
    ds.mem.adj_rows = 0;
}

void dream_walk_clear(dream_stage & ds) {
    for (auto & buf : ds.mem.adj_bufs) {
        ggml_backend_buffer_clear(buf.get(), 0);
    }
}
