// The walk's internal interface, shared by dream-walk.cpp (the attention hook,
// the chunk order, the advance), dream-fit.cpp (fitting a graph to the
// backends), dream-build.cpp (a micro-step's graph) and dream-step.cpp (the
// micro-step). Never included by others.
#pragma once

#include "dream-stage.h"

#include "llama-graph.h"

#include <memory>

// dream-walk.cpp
// [a, b) cut where it wraps around the adjoint buffers' slots (q % adj_rows).
struct dream_ring_piece {
    int32_t pos, slot, len;
};
std::vector<dream_ring_piece> dream_ring_pieces(const dream_stage & ds, int32_t a, int32_t b);
// The slots [slot, slot + len) of one layer's adjoint buffer.
ggml_tensor * dream_adj_view(ggml_context * ctx, ggml_tensor * adj, int32_t slot, int32_t len);
// Positions [from, from + len) of a contiguous [.., .., cells] tensor whose first cell is `first`.
ggml_tensor * dream_cells_view(ggml_context * ctx, ggml_tensor * t, int32_t first, int32_t from, int32_t len);
void    dream_build_begin(dream_stage & ds);   // the attention hook builds for ds on this thread from now
int32_t dream_build_end();                     // ... and no more; returns the hook's calls since the begin
bool    dream_exact_window(const dream_stage & ds);   // the window runs the exact walk (or a group)
dream_chunk dream_next_chunk(dream_stage & ds);       // the chunk the next micro-step computes
// After a refused reverse-pass chunk: the horizon halved in whole chunks; 0 when it cannot shrink.
int32_t dream_halve_horizon(dream_stage & ds, int32_t p, int32_t leaf_lo);
// The walk moves past a computed chunk (position, adjoints, the window's end, the optimizer update).
void    dream_step_advance(dream_stage & ds, dream_receipt & r, const dream_chunk & chunk);

// dream-fit.cpp
// The first node on a parameter-to-loss path that ggml cannot differentiate, or null.
const ggml_tensor * dream_find_undifferentiable(ggml_cgraph * g, ggml_tensor * loss);
// The backward graph rewritten so each node runs where its data lives (the same graph when
// nothing changed); pool_need: per device, the largest quantized-weight expansion it takes.
ggml_cgraph * dream_fit_backward(dream_stage & ds, ggml_context * ctx, ggml_cgraph * gb, size_t cap,
                                 std::vector<std::pair<ggml_backend_dev_t, size_t>> & pool_need);

// dream-build.cpp: one micro-step's graph (dream-step.cpp holds the scope and plans the shape)
// Frees the backward context and ends the graph's use of the stage's scheduler
// on every exit path but one: a step whose graph the stage keeps for the next
// chunk of its shape (keep; the context then belongs to ds.exec.step_graph).
struct dream_graph_scope {
    dream_stage & ds;
    ggml_context * ctx = nullptr;
    int32_t revert_from = -1;   // training-cache cells to drop on failure
    bool keep = false;
    explicit dream_graph_scope(dream_stage & d) : ds(d) {}
    ~dream_graph_scope() {
        dream_build_end();
        if (!keep) {
            dream_step_graph_drop(ds);   // the scheduler's allocation goes: a kept graph with it
            dream_sched_release(ds);
        }
        if (revert_from >= 0) {
            ds.mem.cache->seq_rm(0, revert_from, -1);
        }
        if (ctx) {
            ggml_free(ctx);
        }
    }
};

// What a chunk's graph computes (dream_step_plan_chunk): its loss rows and the graph's shape.
struct dream_step_shape {
    std::vector<int32_t> targets;   // row i (input p+i): the token it predicts with loss, or -1
    int32_t n_loss = 0;
    int32_t n_out = 1;              // logits rows: the loss rows, or one
    bool train = false;             // the step goes backward
    bool soft = false;              // labels from dream_window_soft_targets (dream-soft.cpp)
    bool soft_rest = false;         // ... whose rows leave mass out: dream_soft_rest_ce
    float loss_scale = 0.0f;        // this chunk's share of the window's mean loss (times a group reply's weight)
};

// Places the chunk's cells [p, p + n) in the training cache (scope reverts them on failure); null on error.
std::unique_ptr<llama_kv_cache_context> dream_step_place(dream_stage & ds, dream_receipt & r, const dream_chunk & c,
                                                         const dream_step_shape & sh, dream_graph_scope & scope);
// The training graph's parameters over serving's (copied, never changed) for the placed chunk.
llm_graph_params dream_step_graph_params(dream_stage & ds, const dream_step_shape & sh,
                                         const llama_kv_cache_context & mctx, ggml_backend_sched_t sched);
// A fresh training graph into sgraph (its context held by scope), fitted and planned; needs: what
// allocating it grows, per device. False on error (the receipt says why).
bool dream_step_build(dream_stage & ds, dream_receipt & r, const dream_chunk & c, const dream_step_shape & sh,
                      const llm_graph_params & gp, uint32_t sched_nodes, dream_graph_scope & scope,
                      dream_step_graph & sgraph, std::vector<std::pair<ggml_backend_dev_t, size_t>> & needs);
