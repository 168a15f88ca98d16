// The dream stage on a model split over devices, against the same model on one GPU.
//   dream_split_check MODEL.gguf
// With two or more GPUs the split is llama.cpp's layer split over the first two
// (tensor_split 1,1, every layer offloaded); with one GPU it is the CPU and the
// GPU (half the layers offloaded). The reference is every layer on GPU 0
// (split_mode none). Checked, on the same window and LoRA (check_stage.h):
//   - losses and the gradient: within the arithmetic's tolerance (TF32: 1e-3
//     relative loss, 1e-2 gradient rel L2; FP32 via NVIDIA_TF32_OVERRIDE=0 on an
//     F32 model: 1e-5 and 1e-4), and the gradient is not zero;
//   - the optimizer keeps each device's state on that device (dream-optim.cpp)
//     and updates the adapter as the host optimizer does, within the gradient's tolerance;
//   - the gate measures each device: a job whose memory budget leaves no room for
//     a chunk is refused, its receipt names a device of the split, the per-device
//     figures (dream_gate_devices) list every device with need and allowance, the
//     job holds what it held before, and every GPU's free memory is unchanged;
//     a job whose slack exceeds every device's free memory is refused at its start,
//     naming a device, with nothing allocated on any GPU;
//   - serving's compute buffers are the same size after training, and a decode runs.
// Prints one JSON line; exit status 1 when a check fails.
#include "dream.h"
#include "check_stage.h"
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static std::vector<ggml_backend_dev_t> gpus() {
    std::vector<ggml_backend_dev_t> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU) {
            out.push_back(d);
        }
    }
    return out;
}

// every GPU's free memory, MiB (the host's moves with other processes' page cache)
static std::vector<double> free_mib() {
    std::vector<double> out;
    for (ggml_backend_dev_t d : gpus()) {
        size_t f = 0, t = 0;
        ggml_backend_dev_memory(d, &f, &t);
        out.push_back((double) f / (1 << 20));
    }
    return out;
}

struct placement {
    const char * name;
    int n_gpu_layers;
    llama_split_mode mode;
    std::vector<float> split;   // tensor_split, llama_max_devices() long
};

static bool load(const char * path, const placement & pl, llama_model ** model, llama_context ** ctx) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = pl.n_gpu_layers;
    mp.use_extra_bufts = false;
    mp.split_mode = pl.mode;
    mp.main_gpu = 0;
    mp.tensor_split = pl.split.empty() ? nullptr : pl.split.data();
    *model = llama_model_load_from_file(path, mp);
    if (!*model) {
        std::fprintf(stderr, "%s: load failed\n", pl.name);
        return false;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_seq_max = 1;
    *ctx = llama_init_from_model(*model, cp);
    return *ctx != nullptr;
}

static std::vector<llama_token> window_tokens(int stride) {
    std::vector<llama_token> toks;
    for (int i = 0; i < 72; ++i) toks.push_back(100 + stride * i % 5000);
    return toks;
}

struct run_result {
    double loss_one = 0, loss_chunked = 0;
    std::vector<float> grad, update, host_update;   // the per-device optimizer's update and the host optimizer's
    bool opt_on_device = false, ok = false;
    size_t serving_before = 0, serving_after = 0;
};

// loss over a whole window at `chunk`, the gradient left in out when asked
static bool window_loss(dream_stage * ds, const std::vector<llama_token> & toks, double & loss, std::vector<float> * grad) {
    std::vector<uint8_t> mask(toks.size(), 1);
    dream_receipt r{};
    dream_window_begin(ds, toks.data(), mask.data(), (int) toks.size(), &r);
    double sum = 0; int cnt = 0;
    while (dream_chunks_left(ds) > 0) {
        if (dream_micro_step(ds, &r) != 0) {
            std::fprintf(stderr, "micro-step: %s\n", r.message);
            return false;
        }
        sum += r.loss * r.tokens; cnt += r.tokens;
    }
    loss = sum / cnt;
    if (grad) {
        grad->resize(dream_n_params(ds));
        dream_gradients(ds, grad->data(), (int64_t) grad->size());
    }
    return true;
}

// three AdamW windows: the parameters' update, and where the optimizer ran
static bool adamw_update(llama_context * ctx, bool host, std::vector<float> & update, bool & on_device) {
    if (host) setenv("DREAMSTAGE_OPTIMIZER", "host", 1);
    dream_receipt r{};
    dream_stage * ds = check_stage(ctx, 24, false, false, r, 1e-3f);
    unsetenv("DREAMSTAGE_OPTIMIZER");
    if (!ds) return false;
    const int64_t n = dream_n_params(ds);
    std::vector<float> before(n), after(n);
    dream_get_parameters(ds, before.data(), n);
    const std::vector<llama_token> toks = window_tokens(53);
    bool ok = true;
    for (int w = 0; w < 3 && ok; ++w) {
        double loss = 0;
        ok = window_loss(ds, std::vector<llama_token>(toks.begin() + 4 * w, toks.end()), loss, nullptr);
    }
    dream_get_parameters(ds, after.data(), n);
    update.resize(n);
    for (int64_t i = 0; i < n; ++i) update[i] = after[i] - before[i];
    on_device = dream_optimizer_on_device(ds);
    dream_free(ds);
    return ok;
}

static run_result run(const char * path, const placement & pl) {
    run_result out;
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    if (!load(path, pl, &model, &ctx)) return out;
    out.serving_before = dream_serving_compute_bytes(ctx);
    const std::vector<llama_token> toks = window_tokens(37);
    bool ok = true;
    for (int chunk : { 96, 24 }) {
        dream_receipt r{};
        dream_stage * ds = check_stage(ctx, chunk, false, false, r);
        ok = ok && ds && window_loss(ds, toks, chunk == 96 ? out.loss_one : out.loss_chunked, chunk == 96 ? &out.grad : nullptr);
        if (ds) dream_free(ds);
    }
    bool host_on_device = true;
    ok = ok && adamw_update(ctx, false, out.update, out.opt_on_device) &&
         adamw_update(ctx, true, out.host_update, host_on_device);
    out.serving_after = dream_serving_compute_bytes(ctx);
    llama_batch b = llama_batch_get_one(const_cast<llama_token *>(toks.data()), (int) toks.size());
    out.ok = ok && !host_on_device && llama_decode(ctx, b) == 0;
    llama_free(ctx);
    llama_model_free(model);
    return out;
}

static double rel_l2(const float * a, const float * ref, size_t n) {
    double d = 0, g = 0;
    for (size_t i = 0; i < n; ++i) { d += std::pow((double) a[i] - ref[i], 2); g += std::pow((double) ref[i], 2); }
    return g > 0 ? std::sqrt(d / g) : INFINITY;
}

struct gate_result {
    std::string chunk_device, init_device, rows;
    bool ok = false;
};

static std::string rows_json(dream_stage * ds) {
    std::vector<dream_gate_device> rows(dream_gate_devices(ds, nullptr, 0));
    dream_gate_devices(ds, rows.data(), (int32_t) rows.size());
    std::string s = "[";
    for (const auto & r : rows) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s{\"device\": \"%s\", \"need_mib\": %.3f, \"allowance_mib\": %.3f}",
                      s.size() > 1 ? ", " : "", r.device, r.need_mib, r.allowance_mib);
        s += buf;
    }
    return s + "]";
}

// the gate on the split: a chunk refused by the budget, then a start refused by the slack
static gate_result gate_checks(const char * path, const placement & pl) {
    gate_result out;
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    if (!load(path, pl, &model, &ctx)) return out;
    const size_t serving = dream_serving_compute_bytes(ctx);
    bool ok = true;
    dream_receipt r{};
    dream_stage * ds = check_stage(ctx, 24, false, false, r);
    if (!ds) { llama_free(ctx); llama_model_free(model); return out; }
    const std::vector<llama_token> toks = window_tokens(37);
    std::vector<uint8_t> mask(toks.size(), 1);
    const double held = dream_held_mib(ds);
    dream_set_budget(ds, held + 0.05);
    dream_window_begin(ds, toks.data(), mask.data(), (int) toks.size(), &r);
    const std::vector<double> before = free_mib();
    dream_micro_step(ds, &r);
    const std::vector<double> after = free_mib();
    out.chunk_device = r.refused_device;
    out.rows = rows_json(ds);
    const int n_rows = dream_gate_devices(ds, nullptr, 0);
    ok = r.status == DREAM_STATUS_REFUSED && n_rows >= 2 && !out.chunk_device.empty() &&
         std::strstr(r.message, r.refused_device) != nullptr && std::fabs(dream_held_mib(ds) - held) < 1e-9;
    for (size_t i = 0; i < before.size(); ++i) {
        ok = ok && std::fabs(before[i] - after[i]) <= 2.0;   // cudaMemGetInfo's granularity
    }
    dream_free(ds);
    // a slack above every device's free memory: refused at the start, naming a device of the split
    double most = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        size_t f = 0, t = 0;
        ggml_backend_dev_memory(ggml_backend_dev_get(i), &f, &t);
        most = std::max(most, (double) f / (1 << 20));
    }
    dream_params p = dream_default_params();
    p.targets = "attn_q,attn_v"; p.rank = 2; p.context_cache_type = "f32"; p.window = 96; p.chunk = 24;
    p.slack_mib = most + 1024;
    const std::vector<double> before_init = free_mib();
    dream_receipt ri{};
    dream_stage * none = dream_init(ctx, p, &ri);
    const std::vector<double> after_init = free_mib();
    out.init_device = ri.refused_device;
    ok = ok && !none && ri.status == DREAM_STATUS_REFUSED && !out.init_device.empty() &&
         std::strstr(ri.message, ri.refused_device) != nullptr;
    for (size_t i = 0; i < before_init.size(); ++i) {
        ok = ok && std::fabs(before_init[i] - after_init[i]) <= 2.0;
    }
    if (none) dream_free(none);
    out.ok = ok && dream_serving_compute_bytes(ctx) == serving;
    llama_free(ctx);
    llama_model_free(model);
    return out;
}

int main(int argc, char ** argv) {
    if (argc < 2) { std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]); return 2; }
    llama_backend_init();
    std::printf("%s\n", dream_build_info());
    const std::vector<ggml_backend_dev_t> g = gpus();
    if (g.empty()) { std::printf("FAILED: no GPU\n"); return 1; }
    placement one{ "one GPU", 99, LLAMA_SPLIT_MODE_NONE, {} };
    placement split{ "", 99, LLAMA_SPLIT_MODE_LAYER, std::vector<float>(llama_max_devices(), 0.0f) };
    if (g.size() >= 2) {
        split.name = "two GPUs, layer split 1,1";
        split.split[0] = split.split[1] = 1.0f;
    } else {
        // a full load on the CPU: a vocab-only one reads no hyperparameters (n_layer 0, nothing offloaded)
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = 0;
        llama_model * m = llama_model_load_from_file(argv[1], mp);
        if (!m) { std::printf("FAILED: load\n"); return 1; }
        split.name = "CPU + GPU, half the layers offloaded";
        // llama.cpp's -ngl counts the output head first: half the repeating layers and the head
        split.n_gpu_layers = llama_model_n_layer(m) / 2 + 1;
        if (split.n_gpu_layers < 1) { std::printf("FAILED: %s has too few layers to split\n", argv[1]); return 1; }
        split.split.clear();
        llama_model_free(m);
    }
    const run_result ref = run(argv[1], one), sp = run(argv[1], split);
    if (!ref.ok || !sp.ok || ref.grad.size() != sp.grad.size() || ref.grad.empty()) {
        std::printf("FAILED: a run failed (one GPU ok=%d, split ok=%d)\n", ref.ok, sp.ok);
        return 1;
    }
    const gate_result gate = gate_checks(argv[1], split);
    const char * tf = std::getenv("NVIDIA_TF32_OVERRIDE");
    const bool fp32 = tf && std::strcmp(tf, "0") == 0;
    const double tol_loss = fp32 ? 1e-5 : 1e-3, tol_grad = fp32 ? 1e-4 : 1e-2;
    const size_t n = ref.grad.size();
    const double grad_rel = rel_l2(sp.grad.data(), ref.grad.data(), n);
    const bool both = sp.update.size() == n && sp.host_update.size() == n;
    const double opt_rel = both ? rel_l2(sp.update.data(), sp.host_update.data(), n) : INFINITY;
    double gnorm = 0, unorm = 0;
    for (float x : sp.grad) gnorm += (double) x * x;
    for (size_t i = 0; i < n && both; ++i) unorm += (double) sp.host_update[i] * sp.host_update[i];
    auto close = [](double a, double b, double tol) { return std::fabs(a - b) <= tol * std::fabs(b); };
    std::printf("{\"model\": \"%s\", \"split\": \"%s\", \"gpus\": %zu, \"math\": \"%s\", \"loss_one\": [%.7f, %.7f], "
                "\"loss_chunked\": [%.7f, %.7f], \"grad_rel_l2\": %.4e, \"grad_norm\": %.4e, \"n_params\": %zu, "
                "\"optimizer_on_devices\": %s, \"update_norm\": %.4e, \"update_rel_l2_device_vs_host\": %.4e, "
                "\"serving_compute_bytes\": [%zu, %zu], \"refused_chunk_device\": \"%s\", \"refused_start_device\": \"%s\", "
                "\"gate_devices\": %s, \"gate_ok\": %s, \"tol_loss\": %.0e, \"tol_grad\": %.0e}\n",
                argv[1], split.name, g.size(), fp32 ? "fp32" : "tf32", ref.loss_one, sp.loss_one, ref.loss_chunked,
                sp.loss_chunked, grad_rel, std::sqrt(gnorm), n, sp.opt_on_device ? "true" : "false", std::sqrt(unorm),
                opt_rel, sp.serving_before, sp.serving_after, gate.chunk_device.c_str(), gate.init_device.c_str(),
                gate.rows.c_str(), gate.ok ? "true" : "false", tol_loss, tol_grad);
    bool ok = true;
    if (!(gnorm > 0) || !(unorm > 0)) { std::printf("FAILED: a zero gradient or update\n"); ok = false; }
    if (!close(sp.loss_one, ref.loss_one, tol_loss) || !close(sp.loss_chunked, ref.loss_chunked, tol_loss)) {
        std::printf("FAILED: the split's loss differs from one GPU's by more than %.0e\n", tol_loss); ok = false;
    }
    if (!(grad_rel <= tol_grad)) { std::printf("FAILED: gradient rel L2 %.3e > %.0e\n", grad_rel, tol_grad); ok = false; }
    if (!sp.opt_on_device || !(opt_rel <= tol_grad)) {
        std::printf("FAILED: the per-device optimizer (on devices: %d) is %.3e from the host optimizer\n", sp.opt_on_device, opt_rel);
        ok = false;
    }
    if (sp.serving_before != sp.serving_after) { std::printf("FAILED: serving's compute buffers changed\n"); ok = false; }
    if (!gate.ok) { std::printf("FAILED: the gate on the split (see refused_*_device and gate_devices)\n"); ok = false; }
    std::printf("%s\n", ok ? "PASS" : "FAILED");
    return ok ? 0 : 1;
}
