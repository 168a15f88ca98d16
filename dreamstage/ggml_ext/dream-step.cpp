// The plain walk: one micro-step = one chunk of the window, forward and (when
// it has loss tokens) backward, on the resident context's backends through the
// stage's own schedulers (dream-sched.cpp), with the chunk attending to the
// training cache's prefix. The gradient stops at chunk boundaries (the cached
// prefix is constant); gradients accumulate over the window and AdamW updates
// the shadow adapter at its end. The exact walk and a group carry adjoints back.
// A micro-step resumes a stopped step, or plans, builds, gates and computes one.
#include "dream-walk.h"

#include "ggml-backend.h"
#include "ggml-impl.h"   // struct ggml_cgraph: n_leafs for the scheduler capacity check
#include "llama-batch.h"
#include "llama-graph.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

// When a micro-step that began at t_start is stopped (dream_set_step_deadline), or `ms` after it.
static dream_deadline_t dream_step_deadline(const dream_stage & ds, std::chrono::steady_clock::time_point t_start,
                                            double ms = -1) {
    return t_start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double, std::milli>(ms >= 0 ? ms : ds.exec.step_deadline_ms));
}


// After a step's graph computed: the device pools it grew, its loss and its gradient.
static bool dream_step_read(dream_stage & ds, dream_receipt & r, dream_step_graph & sgraph, bool train, bool need_opt_state) {
    for (const auto & [dev, bytes] : sgraph.pool_need) {
        bool found = false;
        for (auto & [d, b] : ds.exec.pool_held) {
            if (d == dev) {
                b = std::max(b, bytes);
                found = true;
            }
        }
        if (!found) {
            ds.exec.pool_held.push_back({ dev, bytes });
        }
    }

    if (train) {
        float ce_val = 0.0f;
        if (sgraph.ce) {
            ggml_backend_tensor_get(sgraph.ce, &ce_val, 0, sizeof(ce_val));
        }
        r.loss = (double) ce_val;
        if (need_opt_state && !dream_opt_create(ds)) {
            dream_receipt_message(r, "allocating the optimizer state (%.2f MiB) failed", 3.0 * (double) ds.lora.n_params * sizeof(float) / DREAM_MIB);
            return false;
        }
        if (!dream_opt_accumulate(ds, sgraph.param_grads)) {
            dream_receipt_message(r, "adding the step's gradients into the accumulator failed");
            return false;
        }
    }
    return true;
}

namespace {
// One micro-step in progress: what the end of its receipt needs (dream_step_finish).
struct dream_step_run {
    std::chrono::steady_clock::time_point t_start;
    dream_chunk chunk;
    bool walk_new = false;   // the adjoint buffers were allocated by this micro-step
};
}

// A step aborted at its time limit (dream_set_step_abort), already undone by the caller: its receipt.
static int32_t dream_step_aborted(dream_stage & ds, dream_receipt & r, const dream_step_run & run) {
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - run.t_start).count();
    r.aborted_had_ms = ds.exec.step_abort_ms;
    r.aborted_need_ms = ms + ds.exec.aborted_need_ms;
    dream_receipt_message(r, "aborted at the step's time limit of %.1f ms (it needed about %.1f ms): chunk at %d "
                          "(%d tokens) undone, the next micro-step starts it again", r.aborted_had_ms,
                          r.aborted_need_ms, run.chunk.p, run.chunk.n);
    return DREAM_STATUS_ABORTED;
}

// Ends a micro-step's receipt with status; a refused or failed step frees the adjoint buffers it made.
static int32_t dream_step_finish(dream_stage & ds, dream_receipt & r, const dream_step_run & run, int32_t status) {
    r.status = status;
    if (status != DREAM_STATUS_OK && run.walk_new) {
        if (status == DREAM_STATUS_REFUSED) {
            const size_t len = std::strlen(r.message);
            std::snprintf(r.message + len, sizeof(r.message) - len,
                          "; the job held the exact walk's adjoint buffers for it (%d positions, walk_mib %.2f), freed again",
                          ds.mem.adj_rows, (double) ds.mem.walk_bytes / DREAM_MIB);
        }
        dream_walk_free(ds);   // a refused or failed step leaves nothing allocated
    }
    const dream_chunk & chunk = run.chunk;
    if (status == DREAM_STATUS_REFUSED && chunk.backward_pass && !ds.group.active) {
        if (const int32_t h = dream_halve_horizon(ds, chunk.p, chunk.leaf_lo)) {
            const size_t len = std::strlen(r.message);
            std::snprintf(r.message + len, sizeof(r.message) - len, "; horizon halved from %d to %d, the chunk retries",
                          chunk.p - chunk.leaf_lo, h);
            r.horizon = h;   // the receipt names the horizon the retry uses
        }
    }
    r.walk_mib = (double) ds.mem.walk_bytes / DREAM_MIB;
    r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - run.t_start).count();
    r.optimizer_mib = (double) dream_opt_bytes(ds) / DREAM_MIB;
    return status;
}

// Resume: computes on a step stopped at its deadline, with a deadline of its own; a receipt status.
static int32_t dream_step_resume(dream_stage & ds, dream_receipt & r, dream_step_run & run) {
    dream_suspended_step & su = ds.exec.suspended;
    const dream_chunk & chunk = run.chunk = su.chunk;
    r.chunk_pos = chunk.p;
    r.chunk_tokens = chunk.n;
    r.tokens = su.n_loss;
    r.horizon = ds.params.exact ? ds.mem.horizon : -1;
    r.graph_mib = su.graph_mib;
    std::snprintf(r.walk_pass, sizeof(r.walk_pass), "%s", su.train ? "backward" : "forward");
    const dream_deadline_t deadline = dream_step_deadline(ds, run.t_start);
    const dream_deadline_t abort_at = dream_step_deadline(ds, run.t_start, ds.exec.step_abort_ms);
    const ggml_status st = dream_sched_compute(ds, ds.exec.step_graph.gb, su.batched, true, nullptr,
                                               ds.exec.step_deadline_ms > 0 ? &deadline : nullptr, &su.next_node,
                                               ds.exec.step_abort_ms > 0 ? &abort_at : nullptr);
    ds.exec.last_step_stoppable = true;            // it stopped once
    if (st == GGML_STATUS_ABORTED && ds.exec.aborted) {
        dream_suspended_drop(ds);                   // the parts computed before go too: the chunk starts again
        return dream_step_aborted(ds, r, run);
    }
    if (st == GGML_STATUS_ABORTED) {
        dream_receipt_message(r, "stopped at the step deadline of %.1f ms again, %d of %d graph nodes computed: the "
                              "next micro-step goes on with chunk at %d (%d tokens)", ds.exec.step_deadline_ms,
                              su.next_node, ggml_graph_n_nodes(ds.exec.step_graph.gb), chunk.p, chunk.n);
        return DREAM_STATUS_STOPPED;
    }
    if (st != GGML_STATUS_SUCCESS) {
        dream_suspended_drop(ds);
        dream_receipt_message(r, "computing the rest of a stopped step failed (ggml status %d)", (int) st);
        return DREAM_STATUS_ERROR;
    }
    const dream_suspended_step done = su;
    su = dream_suspended_step{};
    if (!dream_step_read(ds, r, ds.exec.step_graph, done.train, done.need_opt_state)) {
        dream_step_graph_drop(ds);
        dream_sched_release(ds);
        return DREAM_STATUS_ERROR;
    }
    if (done.keepable) {
        ds.exec.step_graph.valid = true;         // kept for the next chunk of its shape
        ds.exec.graph_reuses += done.reuse ? 1 : 0;
    } else {
        dream_step_graph_drop(ds);
        dream_sched_release(ds);
    }
    dream_step_advance(ds, r, chunk);
    return DREAM_STATUS_OK;
}

// Plan: the next chunk into run.chunk, its loss rows and graph shape, and their receipt fields.
static dream_step_shape dream_step_plan_chunk(dream_stage & ds, dream_receipt & r, dream_step_run & run) {
    const dream_chunk & chunk = run.chunk = dream_next_chunk(ds);
    const int32_t p = chunk.p, n = chunk.n;
    r.chunk_pos = p;
    r.chunk_tokens = n;
    r.horizon = ds.params.exact ? ds.mem.horizon : -1;
    r.group_reply = chunk.group_reply;
    if (chunk.group_reply >= 0) {   // a group's walk is exact on any stage, over the whole prefix
        r.exact = true;
        r.horizon = 0;
    }
    // a chunk larger than the adjoint slots were sized for gets fewer leaves:
    // the receipt says how many positions it actually gave gradient
    if (chunk.leaf_lo >= 0 && ds.mem.horizon > 0 && chunk.p - chunk.leaf_lo < std::min(ds.mem.horizon, chunk.p)) {
        r.horizon = chunk.p - chunk.leaf_lo;
    }
    // row i (input token p+i) predicts token p+i+1 when that token carries loss
    // (the exact walk's forward sweep only fills the cache: its loss rows are
    // trained when the reverse pass comes back to them)
    dream_step_shape sh;
    sh.targets.assign(n, -1);
    const bool forward_sweep = dream_exact_window(ds) && !chunk.backward_pass;
    sh.soft = dream_soft_active(ds);
    sh.soft_rest = dream_soft_has_rest(ds);
    for (int32_t i = 0; i < n && !forward_sweep; ++i) {
        const int32_t j = p + i + 1;
        if (j < ds.win.n && ds.win.mask[j]) {
            sh.targets[i] = ds.win.tokens[j];
            ++sh.n_loss;
        }
    }
    r.tokens = sh.n_loss;
    // only the rows with a target get logits (the graph gathers their hidden
    // states before the head, as serving does for its output rows): the head
    // is a [n_vocab, rows] product and tensor, and its rows without a target
    // would be computed for nothing; a chunk without loss rows keeps one
    sh.n_out = std::max(sh.n_loss, 1);
    // the plain walk (and the exact walk's forward sweep) goes backward only
    // for loss rows; a reverse-pass chunk also for the adjoints it carries
    sh.train = sh.n_loss > 0 || (chunk.backward_pass && chunk.surrogate);
    std::snprintf(r.walk_pass, sizeof(r.walk_pass), "%s", sh.train ? "backward" : "forward");
    sh.loss_scale = sh.n_loss > 0 ? (float) sh.n_loss / (float) ds.win.n_masked * ds.win.loss_scale : 0.0f;
    return sh;
}

// Plan: the exact walk's adjoint buffers at its first backward chunk, gated and made; a receipt status.
// The graph reads and writes them, so they exist before it is built: first their own gate (with the
// step's host memory, which the graph's gate counts again), then, held by the job, the graph's gate
// sees the rest of the need; a refusal there frees them again (dream_step_finish).
static int32_t dream_step_walk_buffers(dream_stage & ds, dream_receipt & r, dream_step_run & run, bool train) {
    if (!train || !run.chunk.backward_pass || ds.mem.adj_rows != 0) {
        return DREAM_STATUS_OK;
    }
    // (the job's largest chunk, not this one: a pacer may start small)
    const int32_t rows = ds.mem.horizon > 0
                             ? std::min(ds.params.window, ds.mem.horizon + std::max(ds.mem.chunk_max, ds.params.chunk))
                             : ds.params.window;
    auto needs = dream_walk_bytes_planned(ds, rows);
    double total = 0;
    for (const auto & nd : needs) {
        total += (double) nd.second / DREAM_MIB;
    }
    for (const auto & nd : dream_opt_step_needs(ds, train)) {
        needs.push_back(nd);
    }
    const dream_gate_verdict v = dream_gate_check(ds, needs);
    if (!v.fits) {
        dream_receipt_refused(r, run.chunk.p, run.chunk.n, v);
        dream_receipt_message(r, "the exact walk's adjoint buffers (%d positions, walk_mib %.2f) and the step's host "
                              "memory need %.2f MiB on %s, allowance %.2f MiB (budget %.2f MiB, job holds %.2f MiB, "
                              "slack %.2f MiB)%s", rows, total, v.need_mib, v.device.c_str(), v.allowance_mib,
                              ds.params.memory_budget_mib, dream_held_mib(ds), ds.params.slack_mib, v.why.c_str());
        return DREAM_STATUS_REFUSED;
    }
    std::string err;
    if (!dream_walk_create(ds, rows, err)) {
        dream_receipt_message(r, "%s", err.c_str());
        return DREAM_STATUS_ERROR;
    }
    run.walk_new = true;
    run.chunk = dream_next_chunk(ds);   // the same chunk, its leaves bounded by the slots
    return DREAM_STATUS_OK;
}

// Compute: the memory gate over what the step allocates (graph, pool growth, optimizer); false: refused.
static bool dream_step_gate(dream_stage & ds, dream_receipt & r, const dream_chunk & c, const dream_step_graph & sgraph,
                            std::vector<std::pair<ggml_backend_dev_t, size_t>> needs, bool train, bool need_opt_state) {
    // a device pool grows to its largest quantized-weight expansion once and keeps it
    for (const auto & [dev, bytes] : sgraph.pool_need) {
        size_t held = 0;
        for (const auto & [d, b] : ds.exec.pool_held) {
            held = d == dev ? b : held;
        }
        needs.push_back({ dev, bytes > held ? bytes - held : 0 });
    }
    for (const auto & nd : dream_opt_step_needs(ds, train)) {
        needs.push_back(nd);
    }
    r.graph_mib = (double) sgraph.graph_bytes / DREAM_MIB;
    const dream_gate_verdict verdict = dream_gate_check(ds, needs);
    if (verdict.fits) {
        return true;
    }
    dream_receipt_refused(r, c.p, c.n, verdict);
    dream_receipt_message(r, "chunk at %d (%d tokens) needs %.2f MiB more on %s (training graph %.2f MiB planned%s), "
                          "allowance %.2f MiB (budget %.2f MiB, job holds %.2f MiB, slack %.2f MiB)%s",
                          c.p, c.n, verdict.need_mib, verdict.device.c_str(), r.graph_mib,
                          need_opt_state ? " + optimizer state" : "", verdict.allowance_mib,
                          ds.params.memory_budget_mib, dream_held_mib(ds), ds.params.slack_mib, verdict.why.c_str());
    return false;
}

// Compute: the graph's inputs for the placed chunk (ubatch, unit, labels, loss gradient seed).
static void dream_step_set_inputs(dream_stage & ds, const dream_step_graph & sgraph, const dream_step_shape & sh,
                                  int32_t p, const llama_kv_cache_context & mctx) {
    const int64_t n_vocab = ds.model->vocab.n_tokens();
    const int32_t n = (int32_t) sh.targets.size();
    ds.exec.res->set_inputs(&mctx.get_ubatch());
    if (ds.build.unit) {
        const float unit = 1.0f;
        ggml_backend_tensor_set(ds.build.unit, &unit, 0, sizeof(unit));
    }
    if (sgraph.target_ids) {
        std::vector<int64_t> ids;   // the flat index of each loss row's one
        for (int32_t i = 0; i < n; ++i) {
            if (sh.targets[i] >= 0) {
                ids.push_back((int64_t) ids.size() * n_vocab + sh.targets[i]);
            }
        }
        ggml_backend_tensor_set(sgraph.target_ids, ids.data(), 0, ggml_nbytes(sgraph.target_ids));
    }
    if (sgraph.host_labels) {
        // a tensor of the CPU backend: filled where it lies
        GGML_ASSERT(ggml_backend_buffer_is_host(sgraph.host_labels->buffer));
        float * lab = (float *) sgraph.host_labels->data;
        if (sh.soft) {
            float * rest = nullptr;
            if (sgraph.host_rest) {
                GGML_ASSERT(ggml_backend_buffer_is_host(sgraph.host_rest->buffer));
                rest = (float *) sgraph.host_rest->data;
            }
            dream_soft_fill(ds, p, sh.targets, lab, n_vocab, rest);
        } else {
            std::memset(lab, 0, ggml_nbytes(sgraph.host_labels));
            int64_t row = 0;
            for (int32_t i = 0; i < n; ++i) {
                if (sh.targets[i] >= 0) {
                    lab[row++ * n_vocab + sh.targets[i]] = 1.0f;
                }
            }
        }
    }
    if (sgraph.loss_grad) {
        const float one = 1.0f;
        ggml_backend_tensor_set(sgraph.loss_grad, &one, 0, sizeof(one));
    }
}

// Compute: a freshly built graph into the stage's step graph, with what a later step compares.
static void dream_step_keep_fresh(dream_stage & ds, dream_step_graph & fresh, dream_graph_scope & scope,
                                  const dream_chunk & c, const dream_step_shape & sh, bool valid) {
    fresh.ctx.reset(scope.ctx);
    scope.ctx = nullptr;
    fresh.unit = ds.build.unit;
    fresh.p = c.p;
    fresh.n = c.n;
    fresh.n_out = sh.n_out;
    fresh.train = sh.train;
    fresh.soft = sh.soft;
    fresh.soft_rest = sh.soft_rest;
    fresh.loss_scale = sh.loss_scale;
    fresh.valid = valid;
    ds.exec.step_graph = std::move(fresh);
}

// Compute: a stopped step (its graph, inputs and cells kept) becomes ds.exec.suspended; a receipt status.
static int32_t dream_step_suspend(dream_stage & ds, dream_receipt & r, const dream_step_run & run, const dream_step_shape & sh,
                                  dream_step_graph & fresh, dream_graph_scope & scope, bool keepable, bool reuse,
                                  bool need_opt_state, int32_t next_node) {
    const dream_chunk & c = run.chunk;
    if (!reuse) {
        dream_step_keep_fresh(ds, fresh, scope, c, sh, false);   // valid again when the step completes
    }
    ds.exec.step_graph.valid = false;
    ds.exec.suspended = dream_suspended_step{ true, next_node, c, sh.n_loss, sh.train, keepable, reuse, need_opt_state,
                                              c.n > 1, r.graph_mib };
    scope.keep = true;
    scope.revert_from = -1;
    dream_receipt_message(r, "stopped at the step deadline of %.1f ms, %d of %d graph nodes computed: the next "
                          "micro-step goes on with chunk at %d (%d tokens)", ds.exec.step_deadline_ms, next_node,
                          ggml_graph_n_nodes(ds.exec.step_graph.gb), c.p, c.n);
    return DREAM_STATUS_STOPPED;
}

// Compute: allocates the graph once on the exec scheduler (unless reused), computes it, reads the
// step's results and keeps the plain walk's graph for the next chunk of its shape; a receipt status.
static int32_t dream_step_compute(dream_stage & ds, dream_receipt & r, const dream_step_run & run,
                                  const dream_step_shape & sh, dream_step_graph & fresh, bool reuse, bool keepable,
                                  bool need_opt_state, dream_graph_scope & scope, const llama_kv_cache_context & mctx) {
    const dream_chunk & c = run.chunk;
    dream_step_graph & sgraph = reuse ? ds.exec.step_graph : fresh;
    // the step deadline (dream_set_step_deadline): only a graph that writes
    // nothing but this chunk's own cache cells may stop midway and go on later
    // (and only such a graph may be aborted at the time limit: undoing it is reverting those cells)
    const bool can_stop = !c.backward_pass && c.group_reply < 0;
    const bool stoppable = ds.exec.step_deadline_ms > 0 && can_stop;
    const bool abortable = ds.exec.step_abort_ms > 0 && can_stop;
    const dream_deadline_t deadline = dream_step_deadline(ds, run.t_start);
    const dream_deadline_t abort_at = dream_step_deadline(ds, run.t_start, ds.exec.step_abort_ms);
    int32_t next_node = 0;
    const ggml_status st = dream_sched_compute(ds, sgraph.gb, c.n > 1, reuse,
                                               [&] { dream_step_set_inputs(ds, sgraph, sh, c.p, mctx); },
                                               stoppable ? &deadline : nullptr, &next_node,
                                               abortable ? &abort_at : nullptr);
    ds.exec.last_step_stoppable = can_stop && ds.exec.last_one_cpu_split;
    if (st == GGML_STATUS_ABORTED && ds.exec.aborted) {
        // nothing read, accumulated or advanced; the scope drops the graph and reverts the chunk's cells
        return dream_step_aborted(ds, r, run);
    }
    if (st == GGML_STATUS_ABORTED && stoppable) {
        return dream_step_suspend(ds, r, run, sh, fresh, scope, keepable, reuse, need_opt_state, next_node);
    }
    if (st == GGML_STATUS_ALLOC_FAILED) {
        dream_receipt_message(r, "allocating the training graph (%.2f MiB) failed", r.graph_mib);
        return DREAM_STATUS_ERROR;
    }
    if (st == GGML_STATUS_FAILED && ds.fused_attn && !dream_fattn_on_cuda(ds.exec.sched_exec.get(), sgraph.gb)) {
        dream_receipt_message(r, "the fused attention backward was scheduled off CUDA; set DREAMSTAGE_FUSED_ATTN=0");
        return DREAM_STATUS_ERROR;
    }
    if (st != GGML_STATUS_SUCCESS) {
        dream_receipt_message(r, "computing the training graph failed (ggml status %d)", (int) st);
        return DREAM_STATUS_ERROR;
    }
    if (!dream_step_read(ds, r, sgraph, sh.train, need_opt_state)) {
        return DREAM_STATUS_ERROR;
    }
    // the plain walk keeps the graph allocated for the next chunk of this shape
    if (keepable) {
        if (!reuse) {
            dream_step_keep_fresh(ds, fresh, scope, c, sh, true);
        } else {
            ds.exec.graph_reuses += 1;
        }
        scope.keep = true;
    }
    scope.revert_from = -1;     // the chunk's K/V stay as constants for later chunks
    dream_step_advance(ds, r, c);
    return DREAM_STATUS_OK;
}

// One micro-step: resume a stopped step, or plan the next chunk, place it,
// build (or reuse) its graph, gate its memory and compute it.
int32_t dream_walk_micro_step(dream_stage & ds, dream_receipt & r) {
    dream_step_run run;
    run.t_start = std::chrono::steady_clock::now();
    dream_receipt_start(ds, r);
    r.step = ds.step + 1;
    if (!ds.win.active || (!dream_exact_window(ds) && ds.win.pos >= ds.win.n)) {
        dream_receipt_message(r, "no window in progress: call dream_window_begin first");
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    if (ds.exec.suspended.active) {
        return dream_step_finish(ds, r, run, dream_step_resume(ds, r, run));
    }
    const dream_step_shape sh = dream_step_plan_chunk(ds, r, run);
    if (ds.model->hparams.n_pos_per_embd() != 1) {
        dream_receipt_message(r, "models with %u positions per token (M-RoPE) are not supported by the dream stage",
                              ds.model->hparams.n_pos_per_embd());
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    if (const int32_t st = dream_step_walk_buffers(ds, r, run, sh.train); st != DREAM_STATUS_OK) {
        return dream_step_finish(ds, r, run, st);
    }
    const dream_chunk & c = run.chunk;
    dream_graph_scope scope(ds);
    const auto mctx = dream_step_place(ds, r, c, sh, scope);
    if (!mctx) {
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    llama_context & lctx = *ds.lctx;
    const uint32_t sched_nodes = lctx.graph_max_nodes(std::min(lctx.n_ctx(), lctx.n_ubatch()));
    if (!dream_sched_ensure(ds, sched_nodes)) {
        dream_receipt_message(r, "could not create the dream stage's schedulers");
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    if (!ds.exec.res) {
        ds.exec.res.reset(new llm_graph_result(sched_nodes));
    }
    const llm_graph_params gp = dream_step_graph_params(ds, sh, *mctx, ds.exec.sched_exec.get());
    // The last step's graph, when this chunk has its shape, is still allocated on the exec
    // scheduler: set its inputs and compute it again (dream_step_graph). Only the plain walk:
    // the exact walk's and a group's graphs carry leaves, adjoint views and surrogates that
    // depend on the chunk's place in the pass.
    const dream_step_graph & sg = ds.exec.step_graph;
    const bool keepable = ds.exec.graph_reuse && !dream_exact_window(ds) && !ds.group.active;
    const bool reuse = keepable && sg.valid && sg.p == c.p && sg.n == c.n && sg.n_out == sh.n_out && sg.train == sh.train &&
                       sg.soft == sh.soft && sg.soft_rest == sh.soft_rest && sg.loss_scale == sh.loss_scale &&
                       ds.exec.res->can_reuse(gp);
    dream_step_graph fresh;   // the graph this step builds, unless it reuses the kept one
    std::vector<std::pair<ggml_backend_dev_t, size_t>> needs;   // what the step allocates, per device
    if (reuse) {
        ds.build.unit = sg.unit;   // allocated already: the gate sees only the step's host memory
    } else if (!dream_step_build(ds, r, c, sh, gp, sched_nodes, scope, fresh, needs)) {
        return dream_step_finish(ds, r, run, DREAM_STATUS_ERROR);
    }
    const bool need_opt_state = sh.train && !dream_opt_ready(ds);
    if (!dream_step_gate(ds, r, c, reuse ? sg : fresh, needs, sh.train, need_opt_state)) {
        return dream_step_finish(ds, r, run, DREAM_STATUS_REFUSED);
    }
    return dream_step_finish(ds, r, run,
                             dream_step_compute(ds, r, run, sh, fresh, reuse, keepable, need_opt_state, scope, *mctx));
}
