// Training memory: a second llama_kv_cache on the resident model, owned by the
// dream stage, sized to the job's window and stored in context_cache_type. It
// holds constants only (the K/V of the window before the current chunk).
#include "dream-stage.h"

#include <cstring>

bool dream_cache_type_from_name(const char * name, ggml_type & out) {
    static const struct { const char * name; ggml_type type; } known[] = {
        { "q8_0", GGML_TYPE_Q8_0 }, { "q4_0", GGML_TYPE_Q4_0 }, { "f16", GGML_TYPE_F16 }, { "f32", GGML_TYPE_F32 },
    };
    if (!name) {
        return false;
    }
    for (const auto & k : known) {
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
        ds.memory.reset(new llama_kv_cache(*ds.model, hp, ds.cache_type, ds.cache_type,
                /*v_trans*/ false, /*offload*/ true, /*unified*/ true, (uint32_t) ds.params.window,
                /*n_seq_max*/ 1, /*n_pad*/ 1, /*n_swa*/ 0, LLAMA_SWA_TYPE_NONE,
                /*mem_other*/ nullptr, nullptr, nullptr, nullptr, "dream"));
    } catch (const std::exception & e) {
        err = std::string("could not create the training cache: ") + e.what();
        ds.memory.reset();
        return false;
    }
    ds.context_bytes = 0;
    for (const auto & [buft, size] : ds.memory->memory_breakdown()) {
        ds.context_bytes += size;
    }
    return true;
}
