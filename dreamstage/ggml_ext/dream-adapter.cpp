// The dream stage's LoRA: shadow (trained) and served copies, both ordinary
// llama_adapter_lora objects so that build_lora_mm applies them unchanged.
#include "dream-stage.h"

#include "ggml-backend.h"

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <sstream>

const char * const dream_target_names[DT_COUNT] = {
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
};

static ggml_tensor * dream_layer_weight(const llama_layer & l, dream_target t) {
    switch (t) {
        case DT_ATTN_Q:    return l.wq;
        case DT_ATTN_K:    return l.wk;
        case DT_ATTN_V:    return l.wv;
        case DT_ATTN_OUT:  return l.wo;
        case DT_FFN_GATE:  return l.ffn_gate;
        case DT_FFN_UP:    return l.ffn_up;
        case DT_FFN_DOWN:  return l.ffn_down;
        default:           return nullptr;
    }
}

static bool dream_parse_targets(const std::string & s, std::vector<dream_target> & out, std::string & err) {
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
        item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
        int found = -1;
        for (int t = 0; t < DT_COUNT; ++t) {
            if (item == dream_target_names[t]) {
                found = t;
            }
        }
        if (found < 0) {
            err = "unknown LoRA target '" + item + "' (known: attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down)";
            return false;
        }
        for (auto t : out) {
            if (t == found) {
                err = "LoRA target '" + item + "' is listed twice";
                return false;
            }
        }
        out.push_back((dream_target) found);
    }
    if (out.empty()) {
        err = "no LoRA targets given";
        return false;
    }
    return true;
}

// Extra buffer types (CPU_REPACK and friends) hold weights in a layout that
// OUT_PROD does not read, so their gradients would be silently wrong.
static bool dream_buft_is_extra(ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev) {
        return false;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_buffer_type_t * (*)(ggml_backend_dev_t))
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra) {
        return false;
    }
    for (ggml_backend_buffer_type_t * p = get_extra(dev); p && *p; ++p) {
        if (*p == buft) {
            return true;
        }
    }
    return false;
}

ggml_backend_buffer_type_t dream_lora_buft(const ggml_tensor * w) {
    ggml_backend_buffer_type_t wbuft = ggml_backend_buffer_get_type(w->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(wbuft);
    if (!dev || ggml_backend_buft_is_host(wbuft)) {
        return ggml_backend_cpu_buffer_type();
    }
    return ggml_backend_dev_buffer_type(dev);
}

static bool dream_make_set(dream_stage & ds, llama_adapter_lora & ad, bool shadow, std::string & err) {
    const int64_t rank = ds.params.rank;
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    for (auto & p : ds.lora.pairs) {
        ggml_backend_buffer_type_t buft = dream_lora_buft(p.weight);
        if (!ctx_of.count(buft)) {
            ggml_init_params ip = { 2 * ds.lora.pairs.size() * ggml_tensor_overhead(), nullptr, true };
            ggml_context * c = ggml_init(ip);
            ad.ctxs.emplace_back(c);
            ctx_of[buft] = c;
        }
        ggml_context * c = ctx_of[buft];
        ggml_tensor * a = ggml_new_tensor_2d(c, GGML_TYPE_F32, p.n_in, rank);
        ggml_tensor * b = ggml_new_tensor_2d(c, GGML_TYPE_F32, rank, p.n_out);
        ggml_format_name(a, "%s.lora_a", p.weight->name);
        ggml_format_name(b, "%s.lora_b", p.weight->name);
        if (shadow) {
            ggml_set_param(a);
            ggml_set_param(b);
            p.a_shadow = a; p.b_shadow = b;
        } else {
            p.a_served = a; p.b_served = b;
        }
        ad.ab_map[p.weight->name] = llama_adapter_lora_weight(a, b);
    }
    for (auto & [buft, c] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            err = std::string("could not allocate the LoRA adapter in ") + ggml_backend_buft_name(buft);
            return false;
        }
        ggml_backend_buffer_clear(buf, 0);  // B starts at zero
        ds.lora.bytes += ggml_backend_buffer_get_size(buf);
        ad.bufs.emplace_back(buf);
    }
    ad.alpha = ds.params.alpha;
    return true;
}

// Resolves targets and layers into ds.lora.pairs (no allocation).
static bool dream_plan_pairs(dream_stage & ds, std::string & err) {
    std::vector<dream_target> targets;
    if (!dream_parse_targets(ds.targets_str, targets, err)) {
        return false;
    }
    const int32_t n_layer = (int32_t) ds.model->hparams.n_layer();
    const int32_t top = ds.params.top_layers <= 0 ? n_layer : std::min(ds.params.top_layers, n_layer);
    ds.lora.pairs.clear();
    for (int32_t il = n_layer - top; il < n_layer; ++il) {
        for (auto t : targets) {
            ggml_tensor * w = dream_layer_weight(ds.model->layers[il], t);
            if (!w) {
                err = "layer " + std::to_string(il) + " has no " + dream_target_names[t] + " weight in this architecture";
                return false;
            }
            if (!w->buffer) {
                err = std::string("weight ") + w->name + " has no buffer";
                return false;
            }
            ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(w->buffer);
            if (dream_buft_is_extra(buft)) {
                err = std::string("weight ") + w->name + " is stored in the extra buffer type " + ggml_backend_buft_name(buft) +
                      " (repacked layout; OUT_PROD gradients would be wrong): load the model with use_extra_bufts=false";
                return false;
            }
            dream_pair p{};
            p.layer = il;
            p.target = t;
            p.weight = w;
            p.n_in = w->ne[0];
            p.n_out = w->ne[1];
            ds.lora.pairs.push_back(p);
        }
    }
    ds.lora.n_params = 0;
    for (auto & p : ds.lora.pairs) {
        ds.lora.n_params += ds.params.rank * (p.n_in + p.n_out);
    }
    return true;
}

size_t dream_adapter_bytes_planned(const dream_stage & ds) {
    // two copies (shadow, served) of F32 A and B
    return 2 * (size_t) ds.lora.n_params * sizeof(float);
}

bool dream_adapter_create(dream_stage & ds, std::string & err) {
    if (ds.lora.pairs.empty() && !dream_plan_pairs(ds, err)) {
        return false;
    }
    ds.lora.shadow.reset(new llama_adapter_lora(ds.model));
    ds.lora.served.reset(new llama_adapter_lora(ds.model));
    ds.lora.bytes = 0;
    if (!dream_make_set(ds, *ds.lora.shadow, true, err) || !dream_make_set(ds, *ds.lora.served, false, err)) {
        return false;
    }
    ds.lora.shadow_set.clear();
    ds.lora.shadow_set[ds.lora.shadow.get()] = 1.0f;

    // A ~ U(-1/sqrt(n_in), 1/sqrt(n_in)) drawn in canonical pair order, B = 0.
    std::mt19937 rng(ds.params.seed);
    std::vector<float> a;
    for (auto & p : ds.lora.pairs) {
        std::uniform_real_distribution<float> U(-1.0f / std::sqrt((float) p.n_in), 1.0f / std::sqrt((float) p.n_in));
        a.resize(ggml_nelements(p.a_shadow));
        for (auto & x : a) {
            x = U(rng);
        }
        ggml_backend_tensor_set(p.a_shadow, a.data(), 0, a.size() * sizeof(float));
    }
    dream_adapter_copy(ds, true);
    return true;
}

bool dream_plan(dream_stage & ds, std::string & err) {
    return dream_plan_pairs(ds, err);
}

void dream_adapter_copy(dream_stage & ds, bool shadow_to_served) {
    std::vector<uint8_t> tmp;
    for (auto & p : ds.lora.pairs) {
        ggml_tensor * src[2] = { p.a_shadow, p.b_shadow };
        ggml_tensor * dst[2] = { p.a_served, p.b_served };
        for (int i = 0; i < 2; ++i) {
            ggml_tensor * s = shadow_to_served ? src[i] : dst[i];
            ggml_tensor * d = shadow_to_served ? dst[i] : src[i];
            tmp.resize(ggml_nbytes(s));
            ggml_backend_tensor_get(s, tmp.data(), 0, tmp.size());
            ggml_backend_tensor_set(d, tmp.data(), 0, tmp.size());
        }
    }
}

bool dream_adapter_read(const dream_stage & ds, bool shadow, float * out) {
    for (auto & p : ds.lora.pairs) {
        ggml_tensor * a = shadow ? p.a_shadow : p.a_served;
        ggml_tensor * b = shadow ? p.b_shadow : p.b_served;
        ggml_backend_tensor_get(a, out, 0, ggml_nbytes(a));
        out += ggml_nelements(a);
        ggml_backend_tensor_get(b, out, 0, ggml_nbytes(b));
        out += ggml_nelements(b);
    }
    return true;
}

void dream_adapter_write(dream_stage & ds, const float * in) {
    for (auto & p : ds.lora.pairs) {
        ggml_backend_tensor_set(p.a_shadow, in, 0, ggml_nbytes(p.a_shadow));
        in += ggml_nelements(p.a_shadow);
        ggml_backend_tensor_set(p.b_shadow, in, 0, ggml_nbytes(p.b_shadow));
        in += ggml_nelements(p.b_shadow);
    }
}
