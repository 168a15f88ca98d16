// Hooks called from patched upstream files (vendor/patches/). Each is a single
// call site; the logic lives in dreamstage/ggml_ext/*.cpp.
#pragma once

#include <stdint.h>

struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;
class llama_kv_cache_context;
class llm_graph_result;
struct llama_adapter_cvec;

// llama_context::graph_max_nodes: the scheduler and graph storage of every
// context are sized for training graphs (forward + backward + gradients) too,
// so a dream micro-step can run on the resident scheduler. Returns the node
// budget to use instead of serving_nodes.
uint32_t dream_hook_sched_graph_nodes(uint32_t serving_nodes);

// llm_graph_context::build_attn (K/V cache variant), cparams.training branch.
// When the graph being built is a dream-stage training graph, stores the
// chunk's K/V into the training cache and returns in *k, *v the attention's
// K/V: the cached prefix (cast to F32, constant) with the chunk's own F32 K/V
// set in place, so the K/V projections get gradients. Returns false for any
// other training graph (upstream behaviour stays).
bool dream_hook_training_kv(ggml_context * ctx, ggml_cgraph * gf, const llama_kv_cache_context * mctx, int32_t il,
                            ggml_tensor * k_cur, ggml_tensor * v_cur, ggml_tensor * k_idxs, ggml_tensor * v_idxs,
                            ggml_tensor ** k, ggml_tensor ** v);

// llm_graph_context::build_lora_mm, after the context's own adapters: y is
// w x so far. When the adapter bank of the context that `cvec` belongs to (its
// control-vector set: one per context, as long-lived as the context, unlike
// its scheduler, which a reserve replaces) is armed
// (dream_bank_set_token_adapters) and holds adapters for w, returns
// y + B[s] A[s] x with each token's slot s (dream-bank.cpp); otherwise returns
// y itself. Never for training graphs. n_tokens: the graph's ubatch tokens.
ggml_tensor * dream_hook_bank_mm(ggml_context * ctx, llm_graph_result * res, const llama_adapter_cvec * cvec, bool training,
                                 int64_t n_tokens, const ggml_tensor * w, ggml_tensor * x, ggml_tensor * y);

// A GGML_OP_CUSTOM node of ours that ggml-cuda runs too (patch 0108): op params
// [DREAM_CUSTOM_TAG_PARAM] hold DREAM_CUSTOM_TAG, the next one the kind. The
// first op params are ggml's custom-op struct (function, tasks, userdata).
#define DREAM_CUSTOM_TAG_PARAM   12
#define DREAM_CUSTOM_TAG         0x5357444d   // "MDWS"
#define DREAM_CUSTOM_SWIGLU_BACK 1            // dream-glu.cpp: SwiGLU's backward, dg then du
#define DREAM_CUSTOM_SOFT_REST_CE      2      // dream-soft.cpp: soft targets' loss rows with their rest (CPU only)
#define DREAM_CUSTOM_SOFT_REST_CE_BACK 3      // ... and its backward (CPU only)
#define DREAM_CUSTOM_BANK_SHRINK 4            // dream-bank.cpp: each token's A[s] x, s from an index
#define DREAM_CUSTOM_BANK_EXPAND 5            // dream-bank.cpp: each token's y + B[s] u
