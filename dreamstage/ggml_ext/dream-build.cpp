// One micro-step's training graph: the chunk placed in the training cache, the
// forward graph through the model's builder (the attention hook joining the
// cache), the loss, the backward with the exact walk's adjoints, and the fit
// and plan of the whole. dream-step.cpp runs the step around it.
#include "dream-walk.h"

#include "ggml-backend.h"
#include "ggml-impl.h"   // struct ggml_cgraph: n_leafs for the scheduler capacity check
#include "llama-batch.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <vector>

// Build: places the chunk's cells [p, p + n) in the training cache (scope reverts them on failure); null on error.
std::unique_ptr<llama_kv_cache_context> dream_step_place(dream_stage & ds, dream_receipt & r, const dream_chunk & c,
                                                         const dream_step_shape & sh, dream_graph_scope & scope) {
    const int32_t p = c.p, n = c.n;
    // a refused earlier try left none
    ds.mem.cache->seq_rm(0, p, -1);
    ds.win.pos = std::min(ds.win.pos, p);
    llama_batch_allocr balloc(ds.model->hparams.n_pos_per_embd());
    llama_ubatch ub = balloc.ubatch_reserve(n, 1);
    for (int32_t i = 0; i < n; ++i) {
        ub.token[i] = ds.win.tokens[p + i];
        ub.pos[i] = p + i;
        ub.n_seq_id[i] = 1;
        ub.seq_id[i] = &ub.seq_id_unq[0];
        // logits only for the rows that carry a loss (the output head is 49,152
        // x n_embd per row, and its backward is a scatter over all of them);
        // a chunk without loss tokens keeps its last row so the graph has one
        ub.output[i] = sh.n_loss > 0 ? sh.targets[i] >= 0 : i == n - 1;
    }
    auto sinfos = ds.mem.cache->prepare({ ub });
    if (sinfos.empty()) {
        dream_receipt_message(r, "the training cache (%d cells) has no room for chunk at %d (%d tokens)", ds.params.window, p, n);
        return nullptr;
    }
    if (!sinfos[0].is_contiguous() || sinfos[0].head() != (uint32_t) p) {
        dream_receipt_message(r, "training cache placed chunk at %d into cell %u, not %d", p, sinfos[0].head(), p);
        return nullptr;
    }
    auto mctx = std::make_unique<llama_kv_cache_context>(ds.mem.cache.get(), sinfos, std::vector<llama_ubatch>{ ub });
    scope.revert_from = p;
    mctx->apply();
    return mctx;
}

// Build: the training graph's parameters over serving's (copied, never changed) for the placed chunk.
llm_graph_params dream_step_graph_params(dream_stage & ds, const dream_step_shape & sh,
                                         const llama_kv_cache_context & mctx, ggml_backend_sched_t sched) {
    llama_context & lctx = *ds.lctx;
    llama_cparams cp = dream_context_access::cparams(lctx);
    cp.training = true;
    cp.flash_attn = ds.fused_attn;   // ggml has no backward for FLASH_ATTN_EXT; dream-fattn.cpp gives one on CUDA
    cp.auto_fa = false;
    cp.causal_attn = true;
    cp.embeddings = false;
    cp.warmup = false;
    return {
        /*.arch        =*/ ds.model->arch,
        /*.hparams     =*/ ds.model->hparams,
        /*.cparams     =*/ cp,
        /*.ubatch      =*/ mctx.get_ubatch(),
        /*.gtype       =*/ LLM_GRAPH_TYPE_DEFAULT,
        /*.sched       =*/ sched,
        /*.backend_cpu =*/ dream_context_access::backend_cpu(lctx),
        /*.cvec        =*/ dream_context_access::cvec(lctx),
        /*.loras       =*/ &ds.lora.shadow_set,
        /*.mctx        =*/ &mctx,
        /*.cross       =*/ dream_context_access::cross(lctx),
        /*.prec_policy =*/ &ds.model->prec_policy,
        /*.samplers    =*/ {},
        /*.n_outputs   =*/ (uint32_t) sh.n_out,
        /*.cb          =*/ [](const llama_ubatch &, ggml_tensor * cur, const char * name, int il) {
            if (il >= 0) {
                ggml_format_name(cur, "%s-%d", name, il);
            } else {
                ggml_set_name(cur, name);
            }
        },
        /*.res         =*/ ds.exec.res.get(),
    };
}

// Build: the forward graph through the model's builder, the attention hook
// joining the training cache (and the exact walk's leaves); null on error.
static ggml_cgraph * dream_step_build_forward(dream_stage & ds, dream_receipt & r, const dream_chunk & c,
                                              const llm_graph_params & gp, int32_t n_out) {
    const auto & hp = ds.model->hparams;
    ds.build.pos = c.p;
    ds.build.unit = nullptr;
    ds.build.leaf_lo = c.leaf_lo;
    ds.build.surrogate = c.surrogate;
    ds.build.leaf_k.assign(hp.n_layer(), nullptr);
    ds.build.leaf_v.assign(hp.n_layer(), nullptr);
    ds.build.sur = nullptr;
    ggml_cgraph * gf = nullptr;
    dream_build_begin(ds);
    try {
        gf = ds.model->build_graph(gp);
    } catch (const std::exception & e) {
        dream_receipt_message(r, "building the training graph failed: %s", e.what());
        return nullptr;   // (the graph scope ends the build)
    }
    const int32_t hook_calls = dream_build_end();
    uint32_t n_kv_layers = 0;
    for (uint32_t il = 0; il < hp.n_layer(); ++il) {
        n_kv_layers += hp.has_kv(il) ? 1 : 0;
    }
    if (!gf || (uint32_t) hook_calls != n_kv_layers) {
        dream_receipt_message(r, "architecture %s did not build its attention through the dream memory (%d of %u layers)",
                              llm_arch_name(ds.model->arch), hook_calls, n_kv_layers);
        return nullptr;
    }
    ggml_tensor * logits = ds.exec.res->get_logits();
    if (!logits || logits->ne[0] != ds.model->vocab.n_tokens() || logits->ne[1] != n_out) {
        dream_receipt_message(r, "the training graph has no [n_vocab, %d] logits", n_out);
        return nullptr;
    }
    return gf;
}

// Build: the chunk's scaled loss over its loss rows (labels, cross-entropy) into sgraph.
static ggml_tensor * dream_step_build_loss(dream_stage & ds, ggml_context * cbw, dream_step_graph & sgraph,
                                           const dream_step_shape & sh, ggml_backend_sched_t sched) {
    const int64_t n_vocab = ds.model->vocab.n_tokens();
    const int32_t n_loss = sh.n_loss;
    ggml_tensor * logits = ds.exec.res->get_logits();
    // the logits hold only the rows with a target (ub.output): cross_entropy_loss's backward assumes
    // every row's labels sum to one, so an all-zero row would still push its softmax into the gradient.
    // With a GPU in the scheduler the one-hot labels are made on the device: a zero matrix (FILL, one
    // write) whose n_loss ones are set through SET_ROWS on its flat view, at r * n_vocab + target[r]:
    // only n_loss indices cross from the host, not a dense n_vocab x n_loss matrix. On the CPU alone
    // the host fills the matrix in place. Soft targets are dense rows: always filled on the host.
    ggml_tensor * labels = nullptr;
    if (ggml_backend_sched_get_n_backends(sched) > 1 && !sh.soft) {
        sgraph.target_ids = ggml_new_tensor_1d(cbw, GGML_TYPE_I64, n_loss);
        ggml_set_name(sgraph.target_ids, "dream_target_ids");
        ggml_set_input(sgraph.target_ids);
        ggml_tensor * zeros = ggml_fill_inplace(cbw, ggml_new_tensor_2d(cbw, GGML_TYPE_F32, 1, n_vocab * n_loss), 0.0f);
        ggml_tensor * ones = ggml_fill_inplace(cbw, ggml_new_tensor_2d(cbw, GGML_TYPE_F32, 1, n_loss), 1.0f);
        labels = ggml_reshape_2d(cbw, ggml_set_rows(cbw, zeros, ones, sgraph.target_ids), n_vocab, n_loss);
    } else {
        sgraph.host_labels = ggml_new_tensor_2d(cbw, GGML_TYPE_F32, n_vocab, n_loss);
        ggml_set_name(sgraph.host_labels, "dream_labels");
        ggml_set_input(sgraph.host_labels);
        labels = sgraph.host_labels;
    }
    if (sh.soft_rest) {
        sgraph.host_rest = ggml_new_tensor_1d(cbw, GGML_TYPE_F32, n_loss);
        ggml_set_name(sgraph.host_rest, "dream_soft_rest");
        ggml_set_input(sgraph.host_rest);
        sgraph.ce = dream_soft_rest_ce(cbw, logits, labels, sgraph.host_rest);   // mean over loss rows
    } else {
        sgraph.ce = ggml_cross_entropy_loss(cbw, logits, labels);   // mean over loss rows
    }
    ggml_set_output(sgraph.ce);
    return ggml_scale(cbw, sgraph.ce, sh.loss_scale);
}

// Build: the exact walk adds each leaf's gradient into gK/gV at its cells, in this
// graph (the buffers are the stage's, so it persists to the chunks before).
static void dream_step_build_adjoints(dream_stage & ds, ggml_context * cbw, ggml_cgraph * gb, const dream_chunk & c) {
    for (uint32_t il = 0; il < ds.model->hparams.n_layer(); ++il) {
        ggml_tensor * leaves[2] = { ds.build.leaf_k[il], ds.build.leaf_v[il] };
        ggml_tensor * adj[2] = { ds.mem.adj_k.empty() ? nullptr : ds.mem.adj_k[il],
                                 ds.mem.adj_v.empty() ? nullptr : ds.mem.adj_v[il] };
        for (int i = 0; i < 2; ++i) {
            ggml_tensor * g = leaves[i] ? ggml_graph_get_grad(gb, leaves[i]) : nullptr;
            if (!g) {
                continue;
            }
            g = ggml_reshape(cbw, ggml_is_contiguous(g) ? g : ggml_cont(cbw, g), leaves[i]);
            for (const auto & pc : dream_ring_pieces(ds, c.leaf_lo, c.p)) {
                ggml_tensor * slots = dream_adj_view(cbw, adj[i], pc.slot, pc.len);
                ggml_tensor * sum = ggml_add(cbw, slots, dream_cells_view(cbw, g, c.leaf_lo, pc.pos, pc.len));
                ggml_build_forward_expand(gb, ggml_cpy(cbw, sum, slots));
            }
        }
    }
}

// Build: the backward of loss (with the exact walk's surrogate) into sgraph.gb, the
// adapter's gradients marked as outputs, rematerialized when params.recompute; false on error.
static bool dream_step_build_backward(dream_stage & ds, dream_receipt & r, ggml_context * cbw, dream_step_graph & sgraph,
                                      const dream_chunk & c, ggml_tensor * loss, size_t cap) {
    // the exact walk: the later chunks' adjoints enter through the surrogate
    if (ds.build.sur) {
        loss = loss ? ggml_add(cbw, loss, ds.build.sur) : ds.build.sur;
    }
    ggml_set_loss(loss);
    ggml_build_forward_expand(sgraph.gb, loss);
    if (const ggml_tensor * bad = dream_find_undifferentiable(sgraph.gb, loss)) {
        dream_receipt_message(r, "op %s (%s, node %s) has no backward pass in ggml", ggml_op_desc(bad),
                              ggml_op_name(bad->op), bad->name);
        return false;
    }
    const int n_forward = ggml_graph_n_nodes(sgraph.gb);
    dream_fused_glu_set(!dream_sched_has_rpc(ds.exec.sched_exec.get()));
    ggml_build_backward_expand(cbw, sgraph.gb, nullptr);
    dream_fused_glu_set(true);
    sgraph.loss_grad = ggml_graph_get_grad(sgraph.gb, loss);
    for (auto & pr : ds.lora.pairs) {
        for (ggml_tensor * t : { pr.a_shadow, pr.b_shadow }) {
            ggml_tensor * g = ggml_graph_get_grad(sgraph.gb, t);
            if (g) {
                ggml_set_output(g);
            }
            sgraph.param_grads.push_back(g);
        }
    }
    dream_step_build_adjoints(ds, cbw, sgraph.gb, c);
    if (ds.params.recompute) {
        std::string err;
        sgraph.gb = dream_recompute(cbw, sgraph.gb, n_forward, cap, err);
        if (!sgraph.gb) {
            dream_receipt_message(r, "%s", err.c_str());
            return false;
        }
    }
    return true;
}

// Build: a fresh training graph into sgraph (its context held by scope) and planned;
// needs: what allocating it grows, per device. False on error (the receipt says why).
bool dream_step_build(dream_stage & ds, dream_receipt & r, const dream_chunk & c, const dream_step_shape & sh,
                      const llm_graph_params & gp, uint32_t sched_nodes, dream_graph_scope & scope,
                      dream_step_graph & sgraph, std::vector<std::pair<ggml_backend_dev_t, size_t>> & needs) {
    ggml_backend_sched_t sched = ds.exec.sched_exec.get();
    dream_step_graph_drop(ds);
    // the graph build may pin nodes to a backend on the scheduler it is given
    // (build_attn without offload_kqv): the exec scheduler, reset, so the pins
    // hold until it allocates the graph
    ggml_backend_sched_reset(sched);
    ds.exec.res->reset();
    ggml_cgraph * gf = dream_step_build_forward(ds, r, c, gp, sh.n_out);
    if (!gf) {
        return false;
    }
    // backward context: loss, labels, gradients, the combined graph
    // ggml_graph_cpy needs a hash set at least as large as the forward graph's
    const size_t cap = std::max<size_t>((size_t) 6 * (ggml_graph_n_nodes(gf) + gf->n_leafs) + 1024, (size_t) gf->size);
    ggml_init_params ip = { ggml_tensor_overhead() * cap + ggml_graph_overhead_custom(cap, true), nullptr, true };
    scope.ctx = ggml_init(ip);
    ggml_context * cbw = scope.ctx;
    sgraph.gb = ggml_new_graph_custom(cbw, cap, sh.train);
    ggml_graph_cpy(gf, sgraph.gb);
    if (sh.train) {
        ggml_tensor * loss = sh.n_loss > 0 ? dream_step_build_loss(ds, cbw, sgraph, sh, sched) : nullptr;
        if (!dream_step_build_backward(ds, r, cbw, sgraph, c, loss, cap)) {
            return false;
        }
    }
    sgraph.gb = dream_fit_backward(ds, cbw, sgraph.gb, cap, sgraph.pool_need);
    if (ggml_graph_n_nodes(sgraph.gb) + sgraph.gb->n_leafs > (int) sched_nodes) {
        dream_receipt_message(r, "the training graph has %d nodes and leaves; the scheduler holds %u",
                              ggml_graph_n_nodes(sgraph.gb) + sgraph.gb->n_leafs, sched_nodes);
        return false;
    }
    // the gate's need: plan a twin of this graph with ggml's allocator on the stage's planning scheduler
    dream_graph_plan plan;
    if (!dream_sched_plan(ds, sgraph.gb, plan)) {
        dream_receipt_message(r, "planning the training graph failed");
        return false;
    }
    needs = plan.needs;
    sgraph.graph_bytes = plan.graph_bytes;
    return true;
}
