// The walk's internal interface, shared by dream-walk.cpp (the attention hook,
// the chunk order, the advance), dream-fit.cpp (fitting a graph to the
// backends) and dream-step.cpp (the micro-step). Never included by others.
#pragma once

#include "dream-stage.h"

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
