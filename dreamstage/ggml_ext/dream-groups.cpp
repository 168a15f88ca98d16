// Shared-prefix groups (docs/architecture/groups.md; the star among the chunk
// trees): one prompt, G weighted replies, one pass of the prompt. The walk
// reuses the exact walk's machinery: the gradient leaves and the surrogate
// (the attention hook in dream-walk.cpp), the micro-step that builds them and
// adds the leaves' gradients into the adjoint buffers (dream-step.cpp), those
// buffers (dream-memory.cpp) and the reverse pass's bookkeeping
// (dream-window.cpp). This file only decides which chunk comes next and what
// the window holds.
//
// Cells: the prompt's first S = n_prefix - 1 tokens are shared. Each reply is a
// child window [S, n_prefix + len) holding the prompt's last token and the
// reply: that token's row predicts the reply's first token, a different target
// per reply, so it cannot be shared (its K/V are the same every time; the row
// is one token of work per reply). The order of micro-steps:
//   1. the shared cells forward, once, filling the training cache;
//   2. per reply: its cells forward and backward like an exact walk whose
//      reverse pass stops at S, every chunk reading [0, its start) as gradient
//      leaves; the shared cells' adjoints add up over the replies, the reply's
//      own are spent and zeroed before the next reply reuses its cells;
//   3. the shared cells' reverse pass, carrying the summed adjoints through the
//      surrogate; then one optimizer update (the group counts as one window).
// Loss: sum_g w_g * mean CE(reply g) / G, so with every weight 1 the gradient
// is that of G separate windows accumulated into one update. The weight scales
// the reply's loss in its graph; the 1/G is applied to the host accumulator
// when the group ends. A scale inside the graph changes float32 rounding all
// through the backward: the same one-chunk graph with its loss scaled by 0.3
// moves 7e-6 (relative L2) from 0.3 x the unscaled gradient, while a power of
// two scales exactly; on the host, 1/G is one correctly rounded division.
#include "dream-stage.h"

#include "llama-impl.h"   // format()

#include <algorithm>
#include <cmath>
#include <limits>

// The window the micro-step sees while reply g is walked: the prompt, then the reply.
static void dream_group_load_reply(dream_stage & ds, int32_t g) {
    auto & gs = ds.group;
    const auto & toks = gs.reply_tokens[g];
    const auto & mask = gs.reply_mask[g];
    ds.win.tokens = gs.prefix;
    ds.win.tokens.insert(ds.win.tokens.end(), toks.begin(), toks.end());
    ds.win.mask.assign(gs.n_prefix, 0);
    ds.win.mask.insert(ds.win.mask.end(), mask.begin(), mask.end());
    ds.win.n = (int32_t) ds.win.tokens.size();
    ds.win.n_masked = 0;
    ds.win.loss_end = 0;
    for (int32_t j = gs.n_prefix; j < ds.win.n; ++j) {
        if (ds.win.mask[j]) {
            ds.win.n_masked += 1;
            ds.win.loss_end = j;
        }
    }
    ds.win.loss_scale = gs.weights[g];
    ds.win.reverse = false;
    ds.win.rev_end = 0;
    ds.win.pos = std::min(ds.win.pos, gs.shared);   // the cache keeps the shared cells only
    gs.reply = g;
    gs.reply_loss[g] = 0.0;
}

// The reverse pass's chunk that ends at e starts on the chunk grid counted from lo.
static int32_t dream_group_rev_start(const dream_stage & ds, int32_t lo, int32_t e) {
    return lo + ((e - 1 - lo) / ds.params.chunk) * ds.params.chunk;
}

dream_chunk dream_group_next_chunk(dream_stage & ds) {
    const auto & gs = ds.group;
    const int32_t G = (int32_t) gs.reply_tokens.size();
    const int32_t S = gs.shared;
    const bool prefix_pass = gs.reply >= G;
    const int32_t lo = prefix_pass ? 0 : S;   // this part's reverse pass stops at lo
    dream_chunk c;
    c.group_reply = gs.reply;
    if (!prefix_pass && ds.win.pos < S) {
        // step 1: the shared cells, forward only
        c.p = ds.win.pos;
        c.n = std::min(ds.params.chunk, S - c.p);
        c.group_reply = G;
        return c;
    }
    const int32_t end = ds.win.reverse ? ds.win.rev_end : ds.win.loss_end;
    const int32_t start = dream_group_rev_start(ds, lo, end);
    if (ds.win.pos < start) {
        // a long reply's forward sweep, or the refill after a refused chunk
        c.p = ds.win.pos;
        c.n = std::min(ds.params.chunk, start - c.p);
        c.group_reply = c.p < S ? G : gs.reply;
        return c;
    }
    dream_reverse_chunk(ds, c, start, end);
    c.leaf_lo = c.p > 0 ? 0 : -1;   // the whole prompt (and the reply before the chunk) receives gradient
    return c;
}

// Zeroes the adjoint slots of [a, b): the group's buffers hold the whole window (slot = position).
static void dream_group_zero_adjoints(dream_stage & ds, int32_t a, int32_t b) {
    GGML_ASSERT(b <= ds.mem.adj_rows);
    for (auto * adj : { &ds.mem.adj_k, &ds.mem.adj_v }) {
        for (ggml_tensor * t : *adj) {
            if (t) {
                ggml_backend_tensor_memset(t, 0, (size_t) a * t->nb[2], (size_t) (b - a) * t->nb[2]);
            }
        }
    }
    std::fill(ds.win.adj.begin() + a, ds.win.adj.begin() + b, 0);
}

bool dream_group_chunk_done(dream_stage & ds, const dream_chunk & c, const dream_receipt & r) {
    if (!c.backward_pass) {
        return false;
    }
    auto & gs = ds.group;
    const int32_t G = (int32_t) gs.reply_tokens.size();
    const int32_t S = gs.shared;
    if (c.leaf_lo >= 0) {
        std::fill(ds.win.adj.begin() + c.leaf_lo, ds.win.adj.begin() + c.p, 1);
    }
    // this chunk read its own cells' adjoints through the surrogate: spent
    if (ds.mem.adj_rows > 0) {
        dream_group_zero_adjoints(ds, c.p, c.p + c.n);
    }
    ds.win.rev_end = c.p;
    if (gs.reply < G) {
        gs.reply_loss[gs.reply] += r.loss * r.tokens / std::max(ds.win.n_masked, 1);
        // reply chunks with nothing to carry back (no loss rows, no adjoint) are skipped
        while (ds.win.rev_end > S) {
            const int32_t s = dream_group_rev_start(ds, S, ds.win.rev_end);
            if (dream_loss_rows(ds, s, ds.win.rev_end) > 0 || dream_has_adjoint(ds, s, ds.win.rev_end)) {
                return false;
            }
            ds.win.rev_end = s;
        }
        if (gs.reply + 1 < G) {
            dream_group_load_reply(ds, gs.reply + 1);
            return false;
        }
        // step 3: the shared cells' reverse pass
        gs.reply = G;
        ds.win.loss_scale = 0.0f;   // the prompt has no loss rows; only the surrogate remains
        ds.win.rev_end = S;
    }
    while (ds.win.rev_end > 0) {
        const int32_t s = dream_group_rev_start(ds, 0, ds.win.rev_end);
        if (dream_has_adjoint(ds, s, ds.win.rev_end)) {
            return false;
        }
        ds.win.rev_end = s;
    }
    // the mean over the replies (the accumulator held G x the group's gradient)
    dream_opt_scale_acc(ds, 1.0f, (float) G);
    gs.active = false;
    return true;
}

int32_t dream_group_chunks_left(const dream_stage & ds) {
    const auto & gs = ds.group;
    const int32_t G = (int32_t) gs.reply_tokens.size();
    const int32_t S = gs.shared, ch = ds.params.chunk;
    auto chunks = [ch](int32_t len) { return (std::max(len, 0) + ch - 1) / ch; };
    if (gs.reply >= G) {
        return std::max(1, chunks(ds.win.rev_end));
    }
    // an upper bound: the shared cells forward, each remaining reply forward and back, the shared cells back
    int32_t left = chunks(S - ds.win.pos) + chunks(S);
    const int32_t end = ds.win.reverse ? ds.win.rev_end : ds.win.loss_end;
    left += 2 * chunks(end - S);
    for (int32_t g = gs.reply + 1; g < G; ++g) {
        left += 2 * chunks(gs.n_prefix + (int32_t) gs.reply_tokens[g].size() - S);
    }
    return std::max(1, left);
}

extern "C" {

// The C API's guard of a group: the error message for arguments dream_group_begin refuses, or
// empty; *longest: the longest reply's length.
static std::string dream_group_refusal(const dream_stage & ds, const llama_token * prefix, int32_t n_prefix,
                                       const llama_token * reply_tokens, const uint8_t * reply_mask,
                                       const int32_t * reply_lengths, const float * weights, int32_t n_replies,
                                       int32_t * longest) {
    if (!prefix || n_prefix < 1) {
        return format("a group needs a prompt of at least 1 token, got n_prefix %d", n_prefix);
    }
    if (n_replies < 1 || !reply_tokens || !reply_mask || !reply_lengths || !weights) {
        return format("a group needs at least 1 reply with tokens, a loss mask, a length and a weight, got n_replies %d", n_replies);
    }
    if (ds.mem.horizon > 0) {
        return format("a group sends gradient into its whole prompt; this stage has horizon %d (a group needs horizon 0)", ds.mem.horizon);
    }
    const int32_t n_vocab = ds.model->vocab.n_tokens();
    for (int32_t i = 0; i < n_prefix; ++i) {
        if (prefix[i] < 0 || prefix[i] >= n_vocab) {
            return format("prompt token %d at position %d is outside the vocabulary (%d)", prefix[i], i, n_vocab);
        }
    }
    *longest = 0;
    int64_t off = 0;
    for (int32_t g = 0; g < n_replies; ++g) {
        const int32_t len = reply_lengths[g];
        if (len < 1) {
            return format("reply %d has %d tokens; every reply needs at least 1", g, len);
        }
        if (!std::isfinite(weights[g])) {
            return format("reply %d has weight %g; weights must be finite", g, (double) weights[g]);
        }
        int32_t masked = 0;
        for (int32_t i = 0; i < len; ++i) {
            const llama_token t = reply_tokens[off + i];
            if (t < 0 || t >= n_vocab) {
                return format("reply %d token %d at position %d is outside the vocabulary (%d)", g, t, i, n_vocab);
            }
            masked += reply_mask[off + i] ? 1 : 0;
        }
        if (masked == 0) {
            return format("reply %d has no loss token (its loss mask is all zero)", g);
        }
        *longest = std::max(*longest, len);
        off += len;
    }
    if (n_prefix + *longest > ds.params.window) {
        return format("prompt (%d tokens) + longest reply (%d tokens) exceed the window (%d)", n_prefix, *longest,
                      ds.params.window);
    }
    return "";
}

int32_t dream_group_begin(struct dream_stage * ds, const llama_token * prefix, int32_t n_prefix,
                          const llama_token * reply_tokens, const uint8_t * reply_mask, const int32_t * reply_lengths,
                          const float * weights, int32_t n_replies, struct dream_receipt * receipt) {
    dream_receipt tmp;
    dream_receipt & r = receipt ? *receipt : tmp;
    dream_receipt_start(*ds, r);
    dream_soft_clear(*ds);   // a group's replies train one-hot labels
    int32_t longest = 0;
    const std::string refusal = dream_group_refusal(*ds, prefix, n_prefix, reply_tokens, reply_mask, reply_lengths,
                                                    weights, n_replies, &longest);
    if (!refusal.empty()) {
        dream_receipt_message(r, "%s", refusal.c_str());
        r.status = DREAM_STATUS_ERROR;
        return r.status;
    }

    dream_suspended_drop(*ds);   // a stopped step of the last window is not continued
    auto & gs = ds->group;
    gs = dream_group_state{};
    gs.n_prefix = n_prefix;
    gs.shared = n_prefix - 1;
    gs.prefix.assign(prefix, prefix + n_prefix);
    int64_t off = 0;
    for (int32_t g = 0; g < n_replies; ++g) {
        gs.reply_tokens.emplace_back(reply_tokens + off, reply_tokens + off + reply_lengths[g]);
        gs.reply_mask.emplace_back(reply_mask + off, reply_mask + off + reply_lengths[g]);
        off += reply_lengths[g];
    }
    gs.weights.assign(weights, weights + n_replies);
    gs.reply_loss.assign(n_replies, std::numeric_limits<double>::quiet_NaN());
    gs.active = true;

    // the window's bookkeeping, as dream_window_begin sets it up
    ds->win.pos = 0;
    ds->win.active = true;
    ds->mem.cache->clear(false);
    ds->win.adj.assign(n_prefix + longest, 0);
    // slot = position: buffers sized for a shorter horizon are made again at the first backward chunk
    if (ds->mem.adj_rows > 0 && ds->mem.adj_rows < n_prefix + longest) {
        dream_walk_free(*ds);
    }
    dream_walk_clear(*ds);
    if (ds->opt.windows_pending == 0) {
        dream_opt_zero_acc(*ds);
    } else {
        // earlier windows of this update: divided by G again when the group ends
        dream_opt_scale_acc(*ds, (float) n_replies, 1.0f);
    }
    dream_group_load_reply(*ds, 0);
    r.chunk_pos = 0;
    return DREAM_STATUS_OK;
}

int32_t dream_group_reply_losses(const struct dream_stage * ds, double * out, int32_t n) {
    const auto & losses = ds->group.reply_loss;
    for (int32_t i = 0; i < n && i < (int32_t) losses.size(); ++i) {
        out[i] = losses[i];
    }
    return (int32_t) losses.size();
}

}
