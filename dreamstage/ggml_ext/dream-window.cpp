// The window's reverse-pass bookkeeping, shared by the walk (dream-walk.cpp, dream-step.cpp) and
// the shared-prefix group's walk (dream-groups.cpp): both depend on this file,
// neither on the other's internals.
#include "dream-stage.h"

// Rows in [p, e) whose next token carries loss.
int32_t dream_loss_rows(const dream_stage & ds, int32_t p, int32_t e) {
    int32_t n = 0;
    for (int32_t i = p; i < e; ++i) {
        n += (i + 1 < ds.win.n && ds.win.mask[i + 1]) ? 1 : 0;
    }
    return n;
}

void dream_reverse_chunk(dream_stage & ds, dream_chunk & c, int32_t start, int32_t end) {
    ds.win.reverse = true;
    ds.win.rev_end = end;
    c.backward_pass = true;
    c.p = start;
    c.n = end - start;
    c.surrogate = dream_has_adjoint(ds, c.p, end);
}

bool dream_has_adjoint(const dream_stage & ds, int32_t p, int32_t e) {
    for (int32_t i = p; i < e; ++i) {
        if (ds.win.adj[i]) {
            return true;
        }
    }
    return false;
}
