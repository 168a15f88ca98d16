// The optimizer: the gradient accumulator over a window (or several) and AdamW.
//
// On the host (the CPU path), the accumulator and the moments are F32 vectors: each micro-step reads
// its gradients back and adds them, and the window's end reads the adapter,
// updates it and writes it back.
//
// When every A and B lives on one GPU, the same state lives there instead
// (dream_opt_choose): a micro-step adds its gradients into the accumulator
// with one small graph of in-place ADDs on that device, and the update is two
// small graphs, the accumulator's squared norm (4 bytes come back, for the
// clip) and ggml's OPT_STEP_ADAMW per tensor on the scaled accumulator. On the
// H200 the host optimizer moved 3 x 45 MB across the bus and through host
// loops every window for rank 16 on all seven targets of a 1B model: 50 to
// 75 ms of a 175 ms step (docs/benchmarks.md). The arithmetic is the host's:
// AdamW with decoupled weight decay, bias corrections 1 / (1 - beta^t), the
// gradient the mean over the pending windows, clipped by its global L2 norm.
//
// An adapter spread over several devices (a model split over GPUs, RPC workers,
// or the CPU and a GPU) keeps that state per device: each device accumulates,
// measures its part of the norm (4 bytes back) and steps its own tensors, so
// no A, B or moment crosses a bus or the wire.
//
// DREAMSTAGE_OPTIMIZER=host keeps the host optimizer on a GPU; =device puts it
// on the adapter's backend even when that is the CPU (the tests compare both).
#include "dream-stage.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

// Runs fn(lo, hi) over [0, n) in blocks of DREAM_OPT_BLOCK on up to `threads`
// threads (the calling one included). The optimizer's passes are memory-bound:
// at 11 M parameters (rank 16 on all seven targets of a 1B model) the update
// took 73 ms in double and 30 ms in float on one core of the project machine,
// where a 512-token step of that adapter on the H200 took 175 ms.
static constexpr int64_t DREAM_OPT_BLOCK = 1 << 16;

static void dream_opt_parallel(int64_t n, int threads, const std::function<void(int64_t, int64_t)> & fn) {
    const int64_t blocks = (n + DREAM_OPT_BLOCK - 1) / DREAM_OPT_BLOCK;
    // a thread only for work worth starting one (four blocks)
    const int nt = (int) std::max<int64_t>(1, std::min<int64_t>(threads, blocks / 4));
    auto run = [&](int t) {
        for (int64_t b = t; b < blocks; b += nt) {
            fn(b * DREAM_OPT_BLOCK, std::min(n, (b + 1) * DREAM_OPT_BLOCK));
        }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < nt; ++t) {
        pool.emplace_back(run, t);
    }
    run(0);
    for (auto & th : pool) {
        th.join();
    }
}

namespace {
// The A and B tensors in canonical order (the host vectors' order).
std::vector<ggml_tensor *> dream_opt_params(const dream_stage & ds) {
    std::vector<ggml_tensor *> out;
    for (const auto & p : ds.lora.pairs) {
        out.push_back(p.a_shadow);
        out.push_back(p.b_shadow);
    }
    return out;
}

// The device a buffer lives on (dream_buft_device); null: no buffer.
ggml_backend_dev_t dream_buffer_device(ggml_backend_buffer_t buf) {
    return buf ? dream_buft_device(ggml_backend_buffer_get_type(buf)) : nullptr;
}

// A graph for the device optimizer's small jobs, its metadata in the stage's arena.
struct dream_opt_graph {
    ggml_context * ctx = nullptr;
    ggml_cgraph * g = nullptr;
    dream_opt_graph(dream_device_opt & o, size_t n_tensors) {
        const size_t cap = 4 * n_tensors + 16;
        const size_t bytes = ggml_tensor_overhead() * cap + ggml_graph_overhead_custom(cap, false);
        if (o.arena.size() < bytes) {
            o.arena.resize(bytes);
        }
        ggml_init_params ip = { o.arena.size(), o.arena.data(), true };
        ctx = ggml_init(ip);
        g = ggml_new_graph_custom(ctx, cap, false);
    }
    ~dream_opt_graph() { ggml_free(ctx); }
    bool run(dream_device_opt & o) {
        if (!ggml_gallocr_alloc_graph(o.galloc.get(), g)) {
            return false;
        }
        return ggml_backend_graph_compute(o.backend, g) == GGML_STATUS_SUCCESS;
    }
};
}

void dream_opt_choose(dream_stage & ds) {
    ds.opt.devices.clear();
    const dream_opt_where where = ds.switches.optimizer;
    if (where == DREAM_OPT_HOST || ds.lora.pairs.empty()) {
        return;
    }
    // the devices holding A and B tensors, in first-use order
    std::vector<ggml_backend_dev_t> devs;
    bool host = false;
    for (ggml_tensor * t : dream_opt_params(ds)) {
        ggml_backend_dev_t d = dream_buffer_device(t->buffer);
        if (!d) {
            return;
        }
        host = host || ggml_backend_buffer_is_host(t->buffer);
        if (std::find(devs.begin(), devs.end(), d) == devs.end()) {
            devs.push_back(d);
        }
    }
    // one device: there (unless it is the host's, =device aside). Several: each steps its own.
    if (devs.size() == 1 && host && where != DREAM_OPT_DEVICE) {
        return;
    }
    ggml_backend_sched_t serving = ds.lctx->get_sched();
    for (ggml_backend_dev_t dev : devs) {
        ggml_backend_t found = nullptr;
        for (int i = 0; i < ggml_backend_sched_get_n_backends(serving) && !found; ++i) {
            ggml_backend_t be = ggml_backend_sched_get_backend(serving, i);
            found = ggml_backend_get_device(be) == dev ? be : nullptr;
        }
        if (!found) {
            ds.opt.devices.clear();   // a device without a serving backend: the host optimizer
            return;
        }
        ds.opt.devices.emplace_back();
        ds.opt.devices.back().backend = found;
    }
}

bool dream_opt_on_device(const dream_stage & ds) {
    return !ds.opt.devices.empty();
}

bool dream_opt_ready(const dream_stage & ds) {
    return dream_opt_on_device(ds) ? ds.opt.devices[0].buf != nullptr : !ds.opt.grad_acc.empty();
}

size_t dream_opt_bytes(const dream_stage & ds) {
    if (dream_opt_on_device(ds)) {
        size_t total = 0;
        for (const auto & o : ds.opt.devices) {
            total += (o.buf ? ggml_backend_buffer_get_size(o.buf.get()) : 0) +
                     (o.galloc ? ggml_gallocr_get_buffer_size(o.galloc.get(), 0) : 0);
        }
        return total;
    }
    return (ds.opt.grad_acc.size() + ds.opt.adam_m.size() + ds.opt.adam_v.size()) * sizeof(float);
}

std::vector<std::pair<ggml_backend_dev_t, size_t>> dream_opt_step_needs(const dream_stage & ds, bool train) {
    if (!train) {
        return { { dream_host_device(), 0 } };
    }
    const size_t state = dream_opt_ready(ds) ? 0 : (size_t) 3 * ds.lora.n_params * sizeof(float);
    if (dream_opt_on_device(ds)) {
        // the moments and the accumulator, on each tensor's device (the small
        // graphs' intermediates, one tensor's worth, are below the slack)
        std::vector<std::pair<ggml_backend_dev_t, size_t>> out;
        for (const auto & o : ds.opt.devices) {
            out.push_back({ ggml_backend_get_device(o.backend), 0 });
        }
        if (state > 0) {
            for (ggml_tensor * t : dream_opt_params(ds)) {
                ggml_backend_dev_t d = dream_buffer_device(t->buffer);
                for (auto & [dev, bytes] : out) {
                    bytes += dev == d ? 3 * ggml_nbytes(t) : 0;
                }
            }
        }
        return out;
    }
    // ... and the host copy of one step's gradients
    return { { dream_host_device(), state + (size_t) ds.lora.n_params * sizeof(float) } };
}

bool dream_opt_create(dream_stage & ds) {
    if (!dream_opt_on_device(ds)) {
        ds.opt.grad_acc.assign(ds.lora.n_params, 0.0f);
        ds.opt.adam_m.assign(ds.lora.n_params, 0.0f);
        ds.opt.adam_v.assign(ds.lora.n_params, 0.0f);
        return true;
    }
    const auto params = dream_opt_params(ds);
    for (auto & o : ds.opt.devices) {
        ggml_backend_dev_t dev = ggml_backend_get_device(o.backend);
        ggml_init_params ip = { (3 * params.size() + 2) * ggml_tensor_overhead(), nullptr, true };
        o.ctx.reset(ggml_init(ip));
        o.acc.assign(params.size(), nullptr);
        o.m.assign(params.size(), nullptr);
        o.v.assign(params.size(), nullptr);
        for (size_t i = 0; i < params.size(); ++i) {
            if (dream_buffer_device(params[i]->buffer) == dev) {
                o.acc[i] = ggml_dup_tensor(o.ctx.get(), params[i]);
                o.m[i] = ggml_dup_tensor(o.ctx.get(), params[i]);
                o.v[i] = ggml_dup_tensor(o.ctx.get(), params[i]);
            }
        }
        o.grad_scale = ggml_new_tensor_1d(o.ctx.get(), GGML_TYPE_F32, 1);
        o.adamw_params = ggml_new_tensor_1d(o.ctx.get(), GGML_TYPE_F32, 7);
        ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(o.backend);
        o.buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(o.ctx.get(), buft));
        if (!o.buf) {
            o.ctx.reset();
            return false;
        }
        ggml_backend_buffer_clear(o.buf.get(), 0);
        o.galloc.reset(ggml_gallocr_new(buft));
    }
    return true;
}

// Adds a step's gradients into one device's accumulators (its own tensors only).
static bool dream_opt_accumulate_on(dream_device_opt & o, const std::vector<ggml_tensor *> & grads) {
    ggml_backend_dev_t dev = ggml_backend_get_device(o.backend);
    dream_opt_graph og(o, grads.size());
    std::vector<float> a, b;
    for (size_t i = 0; i < grads.size(); ++i) {
        ggml_tensor * g = grads[i];
        if (!g || !o.acc[i]) {
            continue;
        }
        if (dream_buffer_device(g->buffer) == dev) {
            // an op-less alias of the step graph's gradient: this graph must not
            // reach back into the step graph through the gradient's sources
            ggml_tensor * alias = ggml_new_tensor(og.ctx, g->type, GGML_MAX_DIMS, g->ne);
            std::memcpy(alias->nb, g->nb, sizeof(g->nb));
            alias->data = g->data;
            alias->buffer = g->buffer;
            ggml_build_forward_expand(og.g, ggml_add_inplace(og.ctx, o.acc[i], alias));
        } else {
            // a gradient the scheduler computed elsewhere: added through the host
            const int64_t ne = ggml_nelements(g);
            a.resize(ne);
            b.resize(ne);
            ggml_backend_tensor_get(o.acc[i], a.data(), 0, ne * sizeof(float));
            ggml_backend_tensor_get(g, b.data(), 0, ne * sizeof(float));
            for (int64_t k = 0; k < ne; ++k) {
                a[k] += b[k];
            }
            ggml_backend_tensor_set(o.acc[i], a.data(), 0, ne * sizeof(float));
        }
    }
    return ggml_graph_n_nodes(og.g) == 0 || og.run(o);
}

bool dream_opt_accumulate(dream_stage & ds, const std::vector<ggml_tensor *> & grads) {
    if (!dream_opt_on_device(ds)) {
        float * acc = ds.opt.grad_acc.data();
        std::vector<float> host;
        size_t ig = 0;
        for (ggml_tensor * t : dream_opt_params(ds)) {
            const int64_t ne = ggml_nelements(t);
            if (ggml_tensor * g = grads[ig++]) {
                host.resize(ne);
                ggml_backend_tensor_get(g, host.data(), 0, ne * sizeof(float));
                for (int64_t i = 0; i < ne; ++i) {
                    acc[i] += host[i];
                }
            }
            acc += ne;
        }
        return true;
    }
    for (auto & o : ds.opt.devices) {
        if (!dream_opt_accumulate_on(o, grads)) {
            return false;
        }
    }
    return true;
}

void dream_opt_zero_acc(dream_stage & ds) {
    if (!dream_opt_on_device(ds)) {
        std::fill(ds.opt.grad_acc.begin(), ds.opt.grad_acc.end(), 0.0f);
        return;
    }
    for (auto & o : ds.opt.devices) {
        for (ggml_tensor * t : o.acc) {
            if (t) {
                ggml_backend_tensor_memset(t, 0, 0, ggml_nbytes(t));
            }
        }
    }
}

void dream_opt_scale_acc(dream_stage & ds, float mul, float div) {
    if (!dream_opt_on_device(ds)) {
        for (float & x : ds.opt.grad_acc) {
            x = x * mul / div;
        }
        return;
    }
    for (auto & o : ds.opt.devices) {
        if (o.acc.empty()) {
            continue;
        }
        dream_opt_graph og(o, o.acc.size());
        for (ggml_tensor * t : o.acc) {
            if (t) {
                ggml_build_forward_expand(og.g, ggml_scale_inplace(og.ctx, t, mul / div));
            }
        }
        og.run(o);
    }
}

// The host update (the arithmetic both paths share, in float per parameter).
static void dream_opt_update_host(dream_stage & ds, float scale, float ib1, float ib2) {
    const auto & p = ds.params;
    const int64_t n = ds.lora.n_params;
    const int threads = std::max(1, (int) ds.lctx->n_threads_batch());
    std::vector<float> theta(n);
    dream_adapter_read(ds, true, theta.data());
    const float b1 = p.beta1, b2 = p.beta2, lr = p.lr, eps = p.eps, wd = p.weight_decay;
    const float * acc = ds.opt.grad_acc.data();
    float * m = ds.opt.adam_m.data();
    float * v = ds.opt.adam_v.data();
    float * th = theta.data();
    dream_opt_parallel(n, threads, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
            const float g = acc[i] * scale;
            m[i] = b1 * m[i] + (1.0f - b1) * g;
            v[i] = b2 * v[i] + (1.0f - b2) * g * g;
            // decoupled weight decay (AdamW)
            th[i] -= lr * ((m[i] * ib1) / (std::sqrt(v[i] * ib2) + eps) + wd * th[i]);
        }
    });
    dream_adapter_write(ds, theta.data());
}

static double dream_opt_norm2_host(const dream_stage & ds) {
    const int64_t n = ds.lora.n_params;
    const int threads = std::max(1, (int) ds.lctx->n_threads_batch());
    // the squared norm per block, summed in block order: the same on any thread count
    std::vector<double> part((size_t) ((n + DREAM_OPT_BLOCK - 1) / DREAM_OPT_BLOCK), 0.0);
    const float * acc = ds.opt.grad_acc.data();
    dream_opt_parallel(n, threads, [&](int64_t lo, int64_t hi) {
        double s = 0.0;
        for (int64_t i = lo; i < hi; ++i) {
            s += (double) acc[i] * acc[i];
        }
        part[(size_t) (lo / DREAM_OPT_BLOCK)] = s;
    });
    double norm2 = 0.0;
    for (double s : part) {
        norm2 += s;
    }
    return norm2;
}

// The accumulator's squared norm: each device's part there (4 bytes come back from each), summed in device order.
static bool dream_opt_norm2_device(dream_stage & ds, double & norm2) {
    norm2 = 0.0;
    for (auto & o : ds.opt.devices) {
        dream_opt_graph og(o, 3 * o.acc.size());
        ggml_tensor * total = nullptr;
        for (ggml_tensor * t : o.acc) {
            if (t) {
                ggml_tensor * s = ggml_sum(og.ctx, ggml_sqr(og.ctx, t));
                total = total ? ggml_add(og.ctx, total, s) : s;
            }
        }
        if (!total) {
            continue;
        }
        ggml_set_output(total);
        ggml_build_forward_expand(og.g, total);
        if (!og.run(o)) {
            return false;
        }
        float v = 0.0f;
        ggml_backend_tensor_get(total, &v, 0, sizeof(v));
        norm2 += (double) v;
    }
    return true;
}

static bool dream_opt_update_device(dream_stage & ds, float scale, float ib1, float ib2) {
    const auto & p = ds.params;
    // OPT_STEP_ADAMW's parameters: alpha, beta1, beta2, eps, wd, 1/(1-beta1^t), 1/(1-beta2^t)
    const float hp[7] = { p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, ib1, ib2 };
    const auto params = dream_opt_params(ds);
    for (auto & o : ds.opt.devices) {
        ggml_backend_tensor_set(o.adamw_params, hp, 0, sizeof(hp));
        ggml_backend_tensor_set(o.grad_scale, &scale, 0, sizeof(scale));
        dream_opt_graph og(o, 2 * params.size());
        for (size_t i = 0; i < params.size(); ++i) {
            if (!o.acc[i]) {
                continue;
            }
            // the scaled gradient is a temporary: the accumulator keeps the sum (dream_gradients reads it)
            ggml_tensor * g = ggml_mul(og.ctx, o.acc[i], o.grad_scale);
            ggml_build_forward_expand(og.g, ggml_opt_step_adamw(og.ctx, params[i], g, o.m[i], o.v[i], o.adamw_params));
        }
        if (!og.run(o)) {
            return false;
        }
    }
    return true;
}

bool dream_opt_update(dream_stage & ds) {
    const auto & p = ds.params;
    // the mean over the accumulated windows
    const float mean = 1.0f / (float) std::max(ds.opt.windows_pending, 1);
    double norm2 = 0.0;
    if (dream_opt_on_device(ds)) {
        if (!dream_opt_norm2_device(ds, norm2)) {
            return false;
        }
    } else {
        norm2 = dream_opt_norm2_host(ds);
    }
    const double norm = std::sqrt(norm2) * mean;
    const float clip = (p.grad_clip > 0 && norm > p.grad_clip) ? (float) (p.grad_clip / norm) : 1.0f;
    ds.opt.adam_t += 1;
    const float scale = mean * clip;
    // bias corrections as reciprocals; the per-parameter arithmetic in float, so it vectorizes
    const float ib1 = (float) (1.0 / (1.0 - std::pow((double) p.beta1, (double) ds.opt.adam_t)));
    const float ib2 = (float) (1.0 / (1.0 - std::pow((double) p.beta2, (double) ds.opt.adam_t)));
    if (dream_opt_on_device(ds)) {
        return dream_opt_update_device(ds, scale, ib1, ib2);
    }
    dream_opt_update_host(ds, scale, ib1, ib2);
    return true;
}

void dream_opt_read(const dream_stage & ds, int which, float * out) {
    if (!dream_opt_on_device(ds)) {
        const std::vector<float> & src = which == 0 ? ds.opt.grad_acc : which == 1 ? ds.opt.adam_m : ds.opt.adam_v;
        if (src.empty()) {
            std::fill(out, out + ds.lora.n_params, 0.0f);
        } else {
            std::copy(src.begin(), src.end(), out);
        }
        return;
    }
    if (!ds.opt.devices[0].buf) {
        std::fill(out, out + ds.lora.n_params, 0.0f);
        return;
    }
    // canonical order: each tensor from the device that holds it
    const auto params = dream_opt_params(ds);
    for (size_t i = 0; i < params.size(); ++i) {
        for (const auto & o : ds.opt.devices) {
            if (ggml_tensor * t = (which == 0 ? o.acc : which == 1 ? o.m : o.v)[i]) {
                ggml_backend_tensor_get(t, out, 0, ggml_nbytes(t));
            }
        }
        out += ggml_nelements(params[i]);
    }
}

void dream_opt_write(dream_stage & ds, int which, const float * in) {
    if (!dream_opt_on_device(ds)) {
        std::vector<float> & dst = which == 1 ? ds.opt.adam_m : ds.opt.adam_v;
        std::copy(in, in + ds.lora.n_params, dst.begin());
        return;
    }
    // canonical order: each tensor to the device that holds it
    const auto params = dream_opt_params(ds);
    for (size_t i = 0; i < params.size(); ++i) {
        for (const auto & o : ds.opt.devices) {
            if (ggml_tensor * t = (which == 1 ? o.m : o.v)[i]) {
                ggml_backend_tensor_set(t, in, 0, ggml_nbytes(t));
            }
        }
        in += ggml_nelements(params[i]);
    }
}
