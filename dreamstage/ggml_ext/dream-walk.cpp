// The walk's graph side and order: the attention hook that joins a chunk to the
// training cache (and the exact walk's leaves and surrogate), the order of the
// chunks over a window, and the walk's advance past a computed chunk.
// dream-step.cpp runs one micro-step with them; dream-fit.cpp fits its graph.
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

// The stage whose training graph this thread is building (read by the attention hook).
static thread_local dream_stage * g_building = nullptr;
static thread_local int32_t g_hook_calls = 0;

void dream_build_begin(dream_stage & ds) {
    g_building = &ds;
    g_hook_calls = 0;
}

int32_t dream_build_end() {
    g_building = nullptr;
    return g_hook_calls;
}

// The unit scalar of dream_unit_mul, one graph input per training graph.
static ggml_tensor * dream_unit(ggml_context * ctx, dream_stage & ds) {
    if (!ds.build.unit) {
        ds.build.unit = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1);
        ggml_set_name(ds.build.unit, "dream_unit");
        ggml_set_input(ds.build.unit);
    }
    return ds.build.unit;
}

// SET's backward views its incoming gradient with the forward strides, which
// is right only for a contiguous gradient, and build_attn_mha hands it a
// permuted one (measured: K/V LoRA gradients off by more than 100% against
// the NumPy oracle). Multiplying by a unit scalar makes MUL's backward write
// a fresh contiguous gradient before SET's backward reads it.
static ggml_tensor * dream_unit_mul(ggml_context * ctx, dream_stage & ds, ggml_tensor * t) {
    return ggml_mul(ctx, t, dream_unit(ctx, ds));
}

// The exact walk's gradient leaves: the cached cells [lo, pos) cast to F32.
// ggml_set_param only takes op-less tensors, and the cast is a CPY node, so
// the flag is set directly: ggml_build_backward_expand treats any flagged node
// as needing a gradient, and the CPY's own backward stops at the cache (which
// needs none). Its gradient is the adjoint of those cells' K (or V).
static ggml_tensor * dream_leaf(ggml_context * ctx, ggml_tensor * cached, int32_t lo, int32_t pos, const char * name,
                                int32_t il) {
    ggml_tensor * cells = ggml_view_3d(ctx, cached, cached->ne[0], cached->ne[1], pos - lo, cached->nb[1], cached->nb[2],
                                       (size_t) lo * cached->nb[2]);
    ggml_tensor * leaf = ggml_cast(ctx, cells, GGML_TYPE_F32);
    leaf->flags |= GGML_TENSOR_FLAG_PARAM;
    ggml_format_name(leaf, "%s-%d", name, il);
    return leaf;
}

// K for attention: the cache's cells [0, n_kv) cast to F32 (constants), with
// the chunk's own F32 K written over cells [pos, pos + n) so its gradient flows.
// In the exact walk's reverse pass cells [lo, pos) are set in as gradient
// leaves too. Layout [head_dim, n_head_kv, n_kv], as the cache's own view.
static ggml_tensor * dream_join_k(ggml_context * ctx, dream_stage & ds, ggml_tensor * cached, ggml_tensor * k_cur,
                                  int32_t pos, int32_t il) {
    ggml_tensor * base = ggml_cast(ctx, cached, GGML_TYPE_F32);
    const int32_t lo = ds.build.leaf_lo;
    if (lo >= 0 && lo < pos) {
        ggml_tensor * leaf = dream_leaf(ctx, cached, lo, pos, "dream_leaf_k", il);
        ds.build.leaf_k[il] = leaf;
        base = ggml_set(ctx, base, leaf, base->nb[1], base->nb[2], base->nb[3], (size_t) lo * base->nb[2]);
    }
    ggml_tensor * own = ggml_is_contiguous(k_cur) ? k_cur : ggml_cont(ctx, k_cur);
    ggml_tensor * joined = ggml_set(ctx, base, own, base->nb[1], base->nb[2], base->nb[3], (size_t) pos * base->nb[2]);
    return dream_unit_mul(ctx, ds, joined);
}

// V for attention, the same join, but handed over transposed (cells fastest,
// ne [n_kv, n_head_kv, head_dim] with nb[1] > nb[2]): build_attn_mha then
// multiplies it without its own transpose, whose backward would give a
// gradient no CPU binary op accepts.
static ggml_tensor * dream_join_v(ggml_context * ctx, dream_stage & ds, ggml_tensor * cached, ggml_tensor * v_cur,
                                  int32_t pos, int32_t il) {
    // [head_dim, n_head_kv, cells] -> contiguous [cells, head_dim, n_head_kv]
    ggml_tensor * base = ggml_cont(ctx, ggml_permute(ctx, ggml_cast(ctx, cached, GGML_TYPE_F32), 1, 2, 0, 3));
    const int32_t lo = ds.build.leaf_lo;
    if (lo >= 0 && lo < pos) {
        ggml_tensor * leaf = dream_leaf(ctx, cached, lo, pos, "dream_leaf_v", il);
        ds.build.leaf_v[il] = leaf;
        ggml_tensor * leaf_t = ggml_cont(ctx, ggml_permute(ctx, leaf, 1, 2, 0, 3));
        base = ggml_set(ctx, base, leaf_t, base->nb[1], base->nb[2], base->nb[3], (size_t) lo * base->nb[0]);
    }
    ggml_tensor * own = ggml_cont(ctx, ggml_permute(ctx, v_cur, 1, 2, 0, 3));
    ggml_tensor * joined = ggml_set(ctx, base, own, base->nb[1], base->nb[2], base->nb[3], (size_t) pos * base->nb[0]);
    return ggml_permute(ctx, dream_unit_mul(ctx, ds, joined), 0, 2, 1, 3);
}

std::vector<dream_ring_piece> dream_ring_pieces(const dream_stage & ds, int32_t a, int32_t b) {
    std::vector<dream_ring_piece> out;
    while (a < b) {
        const int32_t slot = a % ds.mem.adj_rows;
        const int32_t len = std::min(b - a, ds.mem.adj_rows - slot);
        out.push_back({ a, slot, len });
        a += len;
    }
    return out;
}

// The slots of [pos, pos + len) in one layer's adjoint buffer.
ggml_tensor * dream_adj_view(ggml_context * ctx, ggml_tensor * adj, int32_t slot, int32_t len) {
    return ggml_view_3d(ctx, adj, adj->ne[0], adj->ne[1], len, adj->nb[1], adj->nb[2], (size_t) slot * adj->nb[2]);
}

// Positions [from, from + len) of a contiguous [.., .., cells] tensor whose first cell is `first`.
ggml_tensor * dream_cells_view(ggml_context * ctx, ggml_tensor * t, int32_t first, int32_t from, int32_t len) {
    return ggml_view_3d(ctx, t, t->ne[0], t->ne[1], len, t->nb[1], t->nb[2], (size_t) (from - first) * t->nb[2]);
}

// The exact walk's surrogate for layer il: sum(k_cur * gK) + sum(v_cur * gV)
// over the chunk's own cells, gK and gV constant. Its gradient with respect to
// k_cur and v_cur is the adjoint the later chunks sent back, so backward
// carries their loss into this chunk's parameters and its own ancestors.
static void dream_add_surrogate(ggml_context * ctx, dream_stage & ds, ggml_tensor * k_cur, ggml_tensor * v_cur,
                                int32_t pos, int32_t il) {
    ggml_tensor * cur[2] = { k_cur, v_cur };
    ggml_tensor * adj[2] = { ds.mem.adj_k[il], ds.mem.adj_v[il] };
    for (int i = 0; i < 2; ++i) {
        ggml_tensor * own = ggml_is_contiguous(cur[i]) ? cur[i] : ggml_cont(ctx, cur[i]);
        for (const auto & pc : dream_ring_pieces(ds, pos, pos + (int32_t) own->ne[2])) {
            ggml_tensor * term = ggml_sum(ctx, ggml_mul(ctx, dream_cells_view(ctx, own, pos, pc.pos, pc.len),
                                                        dream_adj_view(ctx, adj[i], pc.slot, pc.len)));
            ds.build.sur = ds.build.sur ? ggml_add(ctx, ds.build.sur, term) : term;
        }
    }
}

bool dream_hook_training_kv(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx, int32_t il,
                            ggml_tensor * k_cur, ggml_tensor * v_cur, ggml_tensor * k_idxs, ggml_tensor * v_idxs,
                            ggml_tensor ** k, ggml_tensor ** v) {
    dream_stage * ds = g_building;
    if (!ds || !mctx || !k_cur || !v_cur) {
        return false;
    }
    ++g_hook_calls;
    // the chunk's K/V become constants for the chunks after it
    ggml_build_forward_expand(gf, mctx->cpy_k(ctx, k_cur, k_idxs, il));
    ggml_build_forward_expand(gf, mctx->cpy_v(ctx, v_cur, v_idxs, il));
    if (ds->build.surrogate) {
        dream_add_surrogate(ctx, *ds, k_cur, v_cur, ds->build.pos, il);
    }
    if (ds->build.pos == 0 && mctx->get_n_kv() == (uint32_t) k_cur->ne[2]) {
        *k = k_cur;
        *v = v_cur;
        return true;
    }
    *k = dream_join_k(ctx, *ds, mctx->get_k(ctx, il), k_cur, ds->build.pos, il);
    *v = dream_join_v(ctx, *ds, mctx->get_v(ctx, il), v_cur, ds->build.pos, il);
    return true;
}

uint32_t dream_hook_sched_graph_nodes(uint32_t serving_nodes) {
    // forward + backward + gradient nodes of a training graph: measured about
    // 3.2x the forward graph for llama-style blocks; 5x leaves headroom.
    return serving_nodes * 5;
}

// A window the exact walk runs (one without loss tokens is forward only, as in
// the plain walk); a shared-prefix group always does (dream-groups.cpp).
bool dream_exact_window(const dream_stage & ds) {
    return (ds.params.exact && ds.win.n_masked > 0) || ds.group.active;
}

// The reverse pass's chunk that ends at e starts on the chunk grid (which
// follows the chunk in use, so a smaller chunk after a refusal just continues).
static int32_t dream_rev_start(const dream_stage & ds, int32_t e) {
    return ((e - 1) / ds.params.chunk) * ds.params.chunk;
}

// Moves rev_end past chunks with nothing to carry back (no loss rows, no adjoint).
static void dream_rev_skip(dream_stage & ds) {
    while (ds.win.rev_end > 0) {
        const int32_t s = dream_rev_start(ds, ds.win.rev_end);
        if (dream_loss_rows(ds, s, ds.win.rev_end) > 0 || dream_has_adjoint(ds, s, ds.win.rev_end)) {
            return;
        }
        ds.win.rev_end = s;
    }
}

// The exact walk: the forward sweep fills the cache up to where the reverse
// pass's next chunk starts (that chunk runs forward and backward in one
// graph); the reverse pass then walks back from the last loss token to 0. The
// cache holds [0, win.pos): a reverse chunk gives up its own cells, so a
// smaller chunk after a refusal first refills the cells it now needs.
dream_chunk dream_next_chunk(dream_stage & ds) {
    if (ds.group.active) {
        return dream_group_next_chunk(ds);
    }
    dream_chunk c;
    if (!dream_exact_window(ds)) {
        c.p = ds.win.pos;
        c.n = std::min(ds.params.chunk, ds.win.n - c.p);
        return c;
    }
    const int32_t end = ds.win.reverse ? ds.win.rev_end : ds.win.loss_end;
    const int32_t start = dream_rev_start(ds, end);
    if (ds.win.pos < start) {
        c.p = ds.win.pos;
        c.n = std::min(ds.params.chunk, start - c.p);
        return c;
    }
    dream_reverse_chunk(ds, c, start, end);
    if (c.p > 0) {
        int32_t h = ds.mem.horizon > 0 ? std::min(ds.mem.horizon, c.p) : c.p;
        if (ds.mem.adj_rows > 0) {
            h = std::min(h, ds.mem.adj_rows - c.n);   // the live adjoints must fit the slots
        }
        c.leaf_lo = h > 0 ? c.p - h : -1;
    }
    return c;
}

int32_t dream_walk_chunks_left(const dream_stage & ds) {
    if (!ds.win.active) {
        return 0;
    }
    if (ds.group.active) {
        return dream_group_chunks_left(ds);
    }
    const int32_t ch = ds.params.chunk;
    if (!dream_exact_window(ds)) {
        return (ds.win.n - ds.win.pos + ch - 1) / ch;
    }
    // an upper bound: the forward chunks still to fill, then every reverse chunk
    const int32_t end = ds.win.reverse ? ds.win.rev_end : ds.win.loss_end;
    const int32_t fwd = (std::max(0, dream_rev_start(ds, end) - ds.win.pos) + ch - 1) / ch;
    return std::max(1, fwd + (end + ch - 1) / ch);
}

// After a refused reverse-pass chunk: halve the horizon in whole chunks (not
// below one chunk), so the retry builds fewer gradient leaves. Returns the new
// horizon, or 0 when it cannot shrink.
int32_t dream_halve_horizon(dream_stage & ds, int32_t p, int32_t leaf_lo) {
    const int32_t ch = ds.params.chunk;
    const int32_t in_use = p - leaf_lo;
    if (leaf_lo < 0 || in_use <= ch) {
        return 0;
    }
    ds.mem.horizon = std::max(ch, (in_use / 2) / ch * ch);
    return ds.mem.horizon;
}

// The walk moves past a computed chunk: the step count, the window's position,
// a group's or the exact walk's bookkeeping, the window's end and the optimizer.
void dream_step_advance(dream_stage & ds, dream_receipt & r, const dream_chunk & chunk) {
    const int32_t p = chunk.p, n = chunk.n;
    ds.step += 1;
    ds.win.pos = p + n;
    bool window_done = !dream_exact_window(ds) && ds.win.pos >= ds.win.n;
    if (ds.group.active) {
        window_done = dream_group_chunk_done(ds, chunk, r);
    } else if (chunk.backward_pass) {
        // the leaves' cells now hold adjoints; this chunk's own slots are
        // spent and must read zero when lower positions wrap onto them
        for (int32_t i = std::max(chunk.leaf_lo, 0); chunk.leaf_lo >= 0 && i < p; ++i) {
            ds.win.adj[i] = 1;
        }
        if (ds.mem.adj_rows > 0 && ds.mem.adj_rows < ds.win.n) {
            for (const auto & pc : dream_ring_pieces(ds, p, p + n)) {
                for (auto * adj : { &ds.mem.adj_k, &ds.mem.adj_v }) {
                    for (ggml_tensor * t : *adj) {
                        if (t) {
                            ggml_backend_tensor_memset(t, 0, (size_t) pc.slot * t->nb[2], (size_t) pc.len * t->nb[2]);
                        }
                    }
                }
            }
        }
        ds.win.rev_end = p;
        dream_rev_skip(ds);
        window_done = ds.win.rev_end == 0;
    }
    if (window_done) {
        ds.win.active = false;
        if (ds.win.n_masked > 0 && dream_opt_ready(ds)) {
            ds.opt.windows_pending += 1;
            if (ds.opt.windows_pending >= ds.params.accumulate_windows) {
                if (!dream_opt_update(ds)) {
                    dream_receipt_message(r, "the optimizer update on the adapter's device failed");
                }
                ds.opt.windows_pending = 0;
            }
        }
    }
}
