// Recompute (activation checkpointing) inside one chunk's training graph.
//
// ggml's backward reads forward tensors (a matmul's inputs, a softmax's
// output, a norm's input), so the allocator keeps every layer's activations
// alive from the forward pass until the backward reaches that layer. Here the
// combined graph is rewritten: each layer's output ("l_out-<il>", named by
// the graph callback) is a checkpoint, and every backward read of a forward
// tensor computed for a layer is pointed at a clone of it, rebuilt from the
// checkpoints just before its first backward use. The originals then die in
// the forward pass, and at any moment the backward holds about one layer's
// activations. The clones run the same ops on the same inputs, so the
// gradient is unchanged; the price is one more forward pass of the layers.
// Nothing here depends on the architecture beyond the l_out name.
#include "dream-stage.h"

#include "ggml-impl.h"

#include <cstring>
#include <unordered_map>
#include <unordered_set>

namespace {

struct dream_recompute_state {
    ggml_context * ctx;
    std::unordered_set<const ggml_tensor *> layer_nodes;   // forward nodes computed for some layer (clonable)
    std::unordered_map<ggml_tensor *, ggml_tensor *> clones;
};

bool dream_is_view_op(ggml_op op) {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

// ggml_cast is a CPY whose destination is the node itself (src[1] == t).
bool dream_is_cast(const ggml_tensor * t) {
    return t->op == GGML_OP_CPY && t->src[1] == t;
}

// A CPY into a fresh graph tensor (ggml_cast, ggml_cpy into a new tensor) can
// be redone into another fresh tensor; a CPY into the cache or a stage buffer cannot.
bool dream_is_fresh_cpy(const ggml_tensor * t) {
    const ggml_tensor * dst = t->src[1];
    return dream_is_cast(t) ||
           (t->op == GGML_OP_CPY && dst && dst->op == GGML_OP_NONE && !dst->buffer && !dst->data &&
            !(dst->flags & (GGML_TENSOR_FLAG_INPUT | GGML_TENSOR_FLAG_OUTPUT | GGML_TENSOR_FLAG_PARAM)));
}

// Whether t can be rebuilt as a new node with the same op: plain compute ops
// with contiguous results, views (rebuilt on their rebuilt source), fresh copies.
bool dream_is_clonable(const ggml_tensor * t) {
    if (t->op == GGML_OP_NONE || (t->flags & (GGML_TENSOR_FLAG_PARAM | GGML_TENSOR_FLAG_OUTPUT))) {
        return false;
    }
    if (dream_is_view_op(t->op) || dream_is_fresh_cpy(t)) {
        return true;
    }
    return !t->view_src && ggml_is_contiguous(t);   // in-place ops write into their source: keep them
}

ggml_tensor * dream_clone(dream_recompute_state & st, ggml_tensor * t) {
    if (!t || !st.layer_nodes.count(t)) {
        return t;
    }
    if (auto it = st.clones.find(t); it != st.clones.end()) {
        return it->second;
    }
    ggml_context * ctx = st.ctx;
    ggml_tensor * src[GGML_MAX_SRC] = {};
    bool changed = false;
    for (int j = 0; j < GGML_MAX_SRC; ++j) {
        src[j] = t->src[j] == t ? t : dream_clone(st, t->src[j]);   // a cast names itself as its destination
        changed = changed || src[j] != t->src[j];
    }
    ggml_tensor * c = nullptr;
    switch (t->op) {
        case GGML_OP_VIEW: {
            if (!changed) {
                c = t;   // a view of a kept tensor costs nothing
                break;
            }
            size_t offset;
            std::memcpy(&offset, t->op_params, sizeof(offset));
            c = ggml_view_4d(ctx, src[0], t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], offset);
        } break;
        case GGML_OP_RESHAPE:
            c = changed ? ggml_reshape_4d(ctx, src[0], t->ne[0], t->ne[1], t->ne[2], t->ne[3]) : t;
            break;
        case GGML_OP_PERMUTE: {
            const int32_t * ax = (const int32_t *) t->op_params;
            c = changed ? ggml_permute(ctx, src[0], ax[0], ax[1], ax[2], ax[3]) : t;
        } break;
        case GGML_OP_TRANSPOSE:
            c = changed ? ggml_transpose(ctx, src[0]) : t;
            break;
        case GGML_OP_CPY:
            c = dream_is_cast(t) ? ggml_cast(ctx, src[0], t->type)
                                 : ggml_cpy(ctx, src[0], ggml_new_tensor(ctx, t->src[1]->type, GGML_MAX_DIMS, t->src[1]->ne));
            break;
        default:
            c = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
            c->op = t->op;
            std::memcpy(c->op_params, t->op_params, sizeof(t->op_params));
            for (int j = 0; j < GGML_MAX_SRC; ++j) {
                c->src[j] = src[j];
            }
            break;
    }
    if (c != t) {
        ggml_format_name(c, "%.56s (re)", t->name);
    }
    st.clones[t] = c;
    return c;
}

}

ggml_cgraph * dream_recompute(ggml_context * ctx, ggml_cgraph * gb, int n_forward, size_t cap, std::string & err) {
    dream_recompute_state st{ ctx, {}, {} };
    // the checkpoints: every layer's output
    std::vector<ggml_tensor *> stack;
    std::unordered_set<const ggml_tensor *> forward, checkpoints;
    for (int i = 0; i < n_forward; ++i) {
        ggml_tensor * t = ggml_graph_node(gb, i);
        forward.insert(t);
        if (std::strncmp(t->name, "l_out-", 6) == 0) {
            checkpoints.insert(t);
            for (int j = 0; j < GGML_MAX_SRC; ++j) {
                if (t->src[j]) {
                    stack.push_back(t->src[j]);
                }
            }
        }
    }
    if (checkpoints.empty()) {
        err = "recompute needs the layers' outputs (l_out-<layer>) in the graph; this architecture names none";
        return nullptr;
    }
    // what the layers compute: forward ancestors of a checkpoint, the checkpoints excluded;
    // the head after the last layer is needed right away by the backward and is kept
    while (!stack.empty()) {
        ggml_tensor * t = stack.back();
        stack.pop_back();
        if (!forward.count(t) || checkpoints.count(t) || !dream_is_clonable(t) || !st.layer_nodes.insert(t).second) {
            continue;
        }
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            if (t->src[j]) {
                stack.push_back(t->src[j]);
            }
        }
    }
    // backward nodes read clones; re-expanding in the original order puts each
    // clone right before its first backward reader
    const int n_nodes = ggml_graph_n_nodes(gb);
    for (int i = n_forward; i < n_nodes; ++i) {
        ggml_tensor * b = ggml_graph_node(gb, i);
        ggml_tensor * was = b->src[0];
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            b->src[j] = dream_clone(st, b->src[j]);
        }
        // a view made by the backward reads its data through view_src: move it
        // onto the clone at the same offset, or it would keep the original alive
        if (b->view_src && dream_is_view_op(b->op) && b->src[0] != was) {
            ggml_tensor * now = b->src[0];
            const size_t rel = b->view_offs - (was->view_src ? was->view_offs : 0);
            b->view_src = now->view_src ? now->view_src : now;
            b->view_offs = (now->view_src ? now->view_offs : 0) + rel;
        }
    }
    ggml_cgraph * out = ggml_new_graph_custom(ctx, cap, false);
    for (int i = 0; i < n_nodes; ++i) {
        ggml_build_forward_expand(out, ggml_graph_node(gb, i));
    }
    return out;
}
