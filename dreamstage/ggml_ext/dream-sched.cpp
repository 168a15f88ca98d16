// The dream stage's schedulers. A training graph is planned, gated, allocated
// and computed on two schedulers the stage owns, over the resident context's
// own backends and buffer types:
//   - `plan` only ever measures (ggml_backend_sched_reserve_size) and holds no
//     compute buffer, so measuring can never free or grow anything;
//   - `exec` allocates the graph once and computes it; its compute buffers are
//     the job's own and go when the stage is freed.
// Serving's scheduler, its compute buffer and its graph-reuse state are never
// touched, so a refusal leaves serving exactly as it was and serving's buffer
// keeps its own size after a job.
//
// Why a twin: splitting a graph rewrites its nodes' sources to the scheduler's
// copy tensors, and those live in a context the next split frees. A graph
// split twice (once to measure, once to allocate) therefore loses its
// cross-backend inputs on the second split; on CUDA the nodes then read
// memory nobody wrote (measured on the H200: loss 0, gradient 0). The plan is
// made on a deep copy of the graph, and the real graph is split exactly once.
#include "dream-stage.h"

#include "ggml-backend.h"
#include "ggml-impl.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>

void dream_sched_deleter::operator()(ggml_backend_sched * s) const {
    if (s) {
        ggml_backend_sched_free(s);
    }
}

// A tensor of the twin graph: same shape, strides, op, parameters, flags and
// storage as t (so allocated tensors keep their buffers and the scheduler
// places them the same way), with its sources mapped into the twin.
static ggml_tensor * dream_twin_tensor(std::unordered_map<const ggml_tensor *, ggml_tensor *> & map, ggml_context * ctx,
                                       ggml_tensor * t) {
    if (!t) {
        return nullptr;
    }
    auto it = map.find(t);
    if (it != map.end()) {
        return it->second;
    }
    ggml_tensor * c = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
    map[t] = c;
    std::memcpy(c->nb, t->nb, sizeof(t->nb));
    c->op = t->op;
    std::memcpy(c->op_params, t->op_params, sizeof(t->op_params));
    c->flags = t->flags;
    c->data = t->data;
    c->buffer = t->buffer;
    c->extra = t->extra;
    c->view_offs = t->view_offs;
    c->view_src = dream_twin_tensor(map, ctx, t->view_src);
    for (int j = 0; j < GGML_MAX_SRC; ++j) {
        c->src[j] = dream_twin_tensor(map, ctx, t->src[j]);
    }
    std::memcpy(c->name, t->name, sizeof(t->name));
    return c;
}

// The twin of g in ctx, nodes and leaves in g's order.
static ggml_cgraph * dream_twin_graph(ggml_context * ctx, ggml_cgraph * g) {
    std::unordered_map<const ggml_tensor *, ggml_tensor *> map;
    map.reserve((size_t) (g->n_nodes + g->n_leafs) * 2);
    ggml_cgraph * twin = ggml_new_graph_custom(ctx, g->size, false);
    for (int i = 0; i < g->n_leafs; ++i) {
        ggml_build_forward_expand(twin, dream_twin_tensor(map, ctx, g->leafs[i]));
    }
    for (int i = 0; i < g->n_nodes; ++i) {
        ggml_build_forward_expand(twin, dream_twin_tensor(map, ctx, g->nodes[i]));
    }
    return twin;
}

static ggml_backend_sched_t dream_new_sched(llama_context & lctx, size_t graph_size) {
    ggml_backend_sched_t serving = lctx.get_sched();
    const int n = ggml_backend_sched_get_n_backends(serving);
    std::vector<ggml_backend_t> backends(n);
    std::vector<ggml_backend_buffer_type_t> bufts(n);
    for (int i = 0; i < n; ++i) {
        backends[i] = ggml_backend_sched_get_backend(serving, i);
        bufts[i] = ggml_backend_sched_get_buffer_type(serving, backends[i]);
    }
    // no pipeline parallelism: one copy of each input, one graph in flight
    return ggml_backend_sched_new(backends.data(), bufts.data(), n, graph_size, /*parallel*/ false,
                                  dream_context_access::cparams(lctx).op_offload);
}

bool dream_sched_ensure(dream_stage & ds, size_t graph_size) {
    if (ds.exec.sched_plan && ds.exec.sched_capacity >= graph_size) {
        return true;
    }
    // a larger graph than any before: both schedulers are made anew (the
    // exec buffers go with the old one; the gate then counts them in full)
    dream_step_graph_drop(ds);
    ds.exec.sched_plan.reset();
    ds.exec.sched_exec.reset();
    ds.exec.sched_plan.reset(dream_new_sched(*ds.lctx, graph_size));
    ds.exec.sched_exec.reset(dream_new_sched(*ds.lctx, graph_size));
    ds.exec.sched_capacity = graph_size;
    return ds.exec.sched_plan && ds.exec.sched_exec;
}

size_t dream_sched_held_bytes(const dream_stage & ds) {
    if (!ds.exec.sched_exec) {
        return 0;
    }
    size_t total = 0;
    ggml_backend_sched_t s = ds.exec.sched_exec.get();
    for (int b = 0; b < ggml_backend_sched_get_n_backends(s); ++b) {
        total += ggml_backend_sched_get_buffer_size(s, ggml_backend_sched_get_backend(s, b));
    }
    return total;
}

// DREAMSTAGE_PROFILE=1: time every node of each training graph (=2: by shape too; the scheduler
// stops and synchronizes after each one, so the step itself gets slower and
// loses ggml-cuda's graphs and fusion) and print the time per op to stderr.
// A profile, not a benchmark: it says where a step's time goes.
namespace {
struct dream_profile {
    bool shapes = false;   // DREAMSTAGE_PROFILE=2
    std::chrono::steady_clock::time_point last;
    std::map<std::string, std::pair<double, int>> per_op;   // ms, count
};

bool dream_profile_eval(ggml_tensor * t, bool ask, void * ud) {
    if (ask) {
        return true;
    }
    auto & p = *(dream_profile *) ud;
    const auto now = std::chrono::steady_clock::now();
    char key[256];
    std::snprintf(key, sizeof(key), "%s %s", ggml_op_desc(t), ggml_type_name(t->src[0] ? t->src[0]->type : t->type));
    if (p.shapes) {
        // DREAMSTAGE_PROFILE=2: by shape too (src0 x src1 -> dst, non-contiguous operands marked)
        auto dims = [](const ggml_tensor * x) {
            char b[48];
            std::snprintf(b, sizeof(b), "%lldx%lld%s", (long long) x->ne[0], (long long) (ggml_nelements(x) / x->ne[0]),
                          ggml_is_contiguous(x) ? "" : "*");
            return std::string(b);
        };
        std::string shape = t->src[0] ? dims(t->src[0]) : "";
        if (t->src[1]) {
            shape += " " + dims(t->src[1]);
        }
        shape += " -> " + dims(t);
        std::snprintf(key + std::strlen(key), sizeof(key) - std::strlen(key), " (%.90s)", shape.c_str());
    }
    if (t->op == GGML_OP_CONT) {
        // a copy's cost is in which tensors are copied: the name without its layer numbers
        std::string name;
        for (const char * c = t->name; *c; ++c) {
            if (*c < '0' || *c > '9') {
                name += *c;
            }
        }
        std::snprintf(key + std::strlen(key), sizeof(key) - std::strlen(key), " [%.100s]", name.c_str());
    }
    auto & e = p.per_op[key];
    e.first += std::chrono::duration<double, std::milli>(now - p.last).count();
    e.second += 1;
    p.last = now;
    return true;
}

}

bool dream_sched_plan(dream_stage & ds, ggml_cgraph * g, dream_graph_plan & plan) {
    const auto t0 = std::chrono::steady_clock::now();
    ggml_backend_sched_t sp = ds.exec.sched_plan.get();
    ggml_backend_sched_t se = ds.exec.sched_exec.get();
    const size_t cap = (size_t) g->n_nodes + g->n_leafs + 16;
    const size_t arena = ggml_tensor_overhead() * cap + ggml_graph_overhead_custom(g->size, false);
    // the twin's metadata lives in an arena the stage keeps, so measuring a
    // chunk (a refused one too) allocates nothing once the first plan is made
    if (ds.exec.twin_arena.size() < arena) {
        ds.exec.twin_arena.resize(arena);
    }
    ggml_init_params ip = { ds.exec.twin_arena.size(), ds.exec.twin_arena.data(), true };
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        return false;
    }
    ggml_cgraph * twin = dream_twin_graph(ctx, g);
    const int n = ggml_backend_sched_get_n_backends(sp);
    std::vector<size_t> sizes(n, 0);
    ggml_backend_sched_reserve_size(sp, twin, sizes.data());
    plan.n_splits = ggml_backend_sched_get_n_splits(sp);
    ggml_backend_sched_reset(sp);
    ggml_free(ctx);
    plan.graph_bytes = 0;
    plan.needs.clear();
    for (int b = 0; b < n; ++b) {
        ggml_backend_t be = ggml_backend_sched_get_backend(se, b);
        const size_t have = ggml_backend_sched_get_buffer_size(se, be);
        plan.graph_bytes += sizes[b];
        plan.needs.push_back({ ggml_backend_get_device(be), sizes[b] > have ? sizes[b] - have : 0 });
    }
    if (ds.switches.profile > 0) {
        std::fprintf(stderr, "dream profile: plan (twin + split + allocator) %.2f ms, %d nodes\n",
                     std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
                     ggml_graph_n_nodes(g));
    }
    return true;
}

// Graph nodes per segment when a step has a deadline: each segment is one
// graph compute on the CPU backend (a few microseconds to start), and the
// deadline is checked between two. A segment of the default model's step
// takes 1 to 4 ms on the project machine, but the one holding the output
// head's product and its backward takes tens of ms at a chunk of 64 or more.
static constexpr int DREAM_SEGMENT_NODES = 64;
static constexpr size_t DREAM_SEGMENT_SHAPES = 64;   // graph shapes whose segment times are kept

// A graph's shape for its segment times: its node count and its first node's
// size (which grows with the chunk's tokens).
static uint64_t dream_segment_key(ggml_cgraph * g) {
    const int n_nodes = ggml_graph_n_nodes(g);
    return ((uint64_t) n_nodes << 40) ^ (uint64_t) ggml_nelements(ggml_graph_node(g, 0));
}

namespace {
// The CPU backend's abort callback while a segment runs under a time limit:
// true from the first node that ends at or after `at` (ggml checks it between nodes).
struct dream_abort_clock {
    dream_deadline_t at;
    bool fired = false;
};

bool dream_abort_due(void * data) {
    auto * a = (dream_abort_clock *) data;
    a->fired = a->fired || std::chrono::steady_clock::now() >= a->at;
    return a->fired;
}

// Serving's abort callback is put back on every exit.
struct dream_abort_scope {
    llama_context * lctx = nullptr;
    ~dream_abort_scope() {
        if (lctx) {
            dream_context_access::set_cpu_abort(*lctx, nullptr, nullptr);
        }
    }
};
}

// Computes g on the CPU backend in segments from *next_node, stopping between two once the
// deadline (if any) passed (GGML_STATUS_ABORTED, *next_node the first node not computed);
// with abort_at, a segment still running then is aborted between two nodes
// (GGML_STATUS_ABORTED, ds.exec.aborted set, ds.exec.aborted_need_ms the rest as last measured).
static ggml_status dream_sched_compute_segments(dream_stage & ds, ggml_cgraph * g, ggml_backend_t cpu,
                                                const dream_deadline_t * deadline, int32_t * next_node,
                                                const dream_deadline_t * abort_at) {
    const int n_nodes = ggml_graph_n_nodes(g);
    // A segment is begun only when it is predicted to end before the
    // deadline (what it took when this shape last ran; unknown: 0). The
    // first segment of a call always runs, so every call makes progress
    // (unless the time limit aborts it: the pacer then shrinks the chunk).
    if (ds.exec.segment_ms.size() > DREAM_SEGMENT_SHAPES) {
        ds.exec.segment_ms.clear();
    }
    std::vector<float> & took = ds.exec.segment_ms[dream_segment_key(g)];
    took.resize((n_nodes + DREAM_SEGMENT_NODES - 1) / DREAM_SEGMENT_NODES, 0.0f);
    dream_abort_clock clock;
    dream_abort_scope restore;
    if (abort_at) {
        clock.at = *abort_at;
        restore.lctx = ds.lctx;
        dream_context_access::set_cpu_abort(*ds.lctx, dream_abort_due, &clock);
    }
    for (int i = *next_node; i < n_nodes; i += DREAM_SEGMENT_NODES) {
        const auto t_seg = std::chrono::steady_clock::now();
        const float predicted = took[i / DREAM_SEGMENT_NODES];
        if (deadline && i > *next_node &&
            t_seg + std::chrono::duration<double, std::milli>(predicted) >= *deadline) {
            *next_node = i;
            return GGML_STATUS_ABORTED;
        }
        ggml_cgraph view = ggml_graph_view(g, i, std::min(n_nodes, i + DREAM_SEGMENT_NODES));
        const ggml_status st = ggml_backend_graph_compute(cpu, &view);
        const float ms =
            (float) std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_seg).count();
        if (st == GGML_STATUS_ABORTED && clock.fired) {
            // the segment takes at least this long now: the deadline stops before it next time
            took[i / DREAM_SEGMENT_NODES] = std::max(took[i / DREAM_SEGMENT_NODES], ms);
            double rest = 0;
            for (size_t j = (size_t) i / DREAM_SEGMENT_NODES + 1; j < took.size(); ++j) {
                rest += took[j];
            }
            ds.exec.aborted = true;
            ds.exec.aborted_need_ms = std::max(0.0, (double) predicted - ms) + rest;
            return GGML_STATUS_ABORTED;
        }
        if (st != GGML_STATUS_SUCCESS) {
            return st;
        }
        took[i / DREAM_SEGMENT_NODES] = ms;
    }
    *next_node = n_nodes;
    return GGML_STATUS_SUCCESS;
}

ggml_status dream_sched_compute(dream_stage & ds, ggml_cgraph * g, bool batched, bool allocated,
                                const std::function<void()> & set_inputs, const dream_deadline_t * deadline,
                                int32_t * next_node, const dream_deadline_t * abort_at) {
    ggml_backend_sched_t se = ds.exec.sched_exec.get();
    ds.exec.aborted = false;
    ds.exec.aborted_need_ms = 0;
    // (the exec scheduler was reset before the graph was built; a reset here
    // would drop the backend pins the build set)
    if (!allocated) {
        if (!ggml_backend_sched_alloc_graph(se, g)) {
            return GGML_STATUS_ALLOC_FAILED;
        }
        // (a kept graph keeps the placement checked here when it was allocated)
        if (ds.fused_attn && !dream_fattn_on_cuda(se, g)) {
            return GGML_STATUS_FAILED;   // ggml's CPU code for the op reads another layout (dream-fattn.cpp)
        }
    }
    if (set_inputs) {
        set_inputs();
    }
    dream_context_access::set_compute_threads(*ds.lctx, batched);
    ggml_backend_t cpu = dream_context_access::backend_cpu(*ds.lctx);
    const int n_nodes = ggml_graph_n_nodes(g);
    // A deadline needs a graph that runs wholly on the CPU backend (one split:
    // its tensors are the graph's own, no copies): it is then computed there in
    // segments, and one that is still running at the deadline stops between two,
    // everything it computed kept, *next_node saying where to go on. A graph
    // with another backend in it runs to its end.
    ds.exec.last_one_cpu_split = cpu && ggml_backend_sched_get_n_splits(se) == 1 && n_nodes > 0 &&
                            ggml_backend_sched_get_tensor_backend(se, ggml_graph_node(g, n_nodes - 1)) == cpu;
    if ((deadline || abort_at) && next_node && ds.exec.last_one_cpu_split) {
        ds.exec.last_n_splits = 1;
        return dream_sched_compute_segments(ds, g, cpu, deadline, next_node, abort_at);
    }
    if (next_node && *next_node > 0) {
        return GGML_STATUS_FAILED;                  // only a segmented graph goes on from a node
    }
    dream_profile prof;
    prof.shapes = ds.switches.profile == 2;
    if (ds.switches.profile > 0) {
        ggml_backend_sched_synchronize(se);
        prof.last = std::chrono::steady_clock::now();
        ggml_backend_sched_set_eval_callback(se, dream_profile_eval, &prof);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const ggml_status st = ggml_backend_sched_graph_compute_async(se, g);
    ggml_backend_sched_synchronize(se);
    ds.exec.last_n_splits = ggml_backend_sched_get_n_splits(se);
    if (ds.switches.profile > 0) {
        ggml_backend_sched_set_eval_callback(se, nullptr, nullptr);
        const double total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        std::vector<std::pair<std::string, std::pair<double, int>>> rows(prof.per_op.begin(), prof.per_op.end());
        std::sort(rows.begin(), rows.end(), [](const auto & a, const auto & b) { return a.second.first > b.second.first; });
        std::fprintf(stderr, "dream profile: %d nodes, %.1f ms computed, %d splits\n", ggml_graph_n_nodes(g), total,
                     ds.exec.last_n_splits);
        for (size_t i = 0; i < rows.size() && i < (prof.shapes ? 80u : 28u); ++i) {
            std::fprintf(stderr, "  %-36s %9.2f ms %5.1f%% x%d\n", rows[i].first.c_str(), rows[i].second.first,
                         100.0 * rows[i].second.first / total, rows[i].second.second);
        }
    }
    return st;
}

void dream_step_graph_drop(dream_stage & ds) {
    ds.exec.step_graph = dream_step_graph{};
}

void dream_sched_release(dream_stage & ds) {
    if (ds.exec.sched_exec) {
        ggml_backend_sched_reset(ds.exec.sched_exec.get());
    }
}

void dream_suspended_drop(dream_stage & ds) {
    if (!ds.exec.suspended.active) {
        return;
    }
    ds.mem.cache->seq_rm(0, ds.exec.suspended.chunk.p, -1);
    ds.win.pos = std::min(ds.win.pos, ds.exec.suspended.chunk.p);
    ds.exec.suspended = dream_suspended_step{};
    dream_step_graph_drop(ds);
    dream_sched_release(ds);
}
