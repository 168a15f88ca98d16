// dreamstage: the dream stage's C interface.
//
// The dream stage trains a LoRA adapter on the resident llama_context between
// serving's decode batches. Everything here is compiled into our libllama and
// reaches llama.cpp internals; only this header is the contract with Python.
//
// Threading: every call on a dream_stage must come from the thread that owns
// the llama_context (the engine thread). Refusals and failures are a status
// plus a receipt, never an abort.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Build identity, a static string owned by the library:
// "dreamstage;llama-cpp-python=<version>;upstream=<commit>;patches=<a.patch,b.patch>;switches=<NAME=value,...>",
// the switches as libllama read them at load (dream-switches.h). Its presence
// proves the loaded libllama is dreamstage's patched build.
LLAMA_API const char * dream_build_info(void);

// Receipt status values.
#define DREAM_STATUS_OK      0
#define DREAM_STATUS_REFUSED 1
#define DREAM_STATUS_ERROR   2
#define DREAM_STATUS_STOPPED 3   // stopped at its deadline; the next micro-step goes on with it (dream_set_step_deadline)
#define DREAM_STATUS_ABORTED 4   // aborted at its time limit and undone; the next micro-step starts the chunk again (dream_set_step_abort)

// One receipt per micro-step (and one for dream_init). Field names are the
// canonical ones, kept unchanged in Python, the job store and the HTTP API
// (docs/architecture/dream-stage.md, "Receipts"); sizes are MiB (2^20 bytes), times ms.
struct dream_receipt {
    int32_t status;                 // DREAM_STATUS_*
    int64_t step;                   // micro-steps taken by this stage, this one included
    int32_t window;                 // configured window, tokens
    int32_t chunk;                  // configured chunk, tokens
    int32_t chunk_pos;              // position of this chunk's first token in the window
    int32_t chunk_tokens;           // input tokens in this chunk
    char    context_cache_type[16]; // training cache type: q8_0, q4_0, f16, f32
    bool    recompute;
    bool    exact;                  // the exact walk (whole-window gradient through the cached K/V)
    int32_t horizon;                // exact walk: ancestors in use that receive gradient, 0 = the whole window; -1: plain walk
    char    walk_pass[12];          // "forward" (the chunk filled the cache only) or "backward" (forward and backward)
    double  loss;                   // mean cross-entropy over this chunk's loss tokens (0 when tokens == 0)
    int32_t tokens;                 // loss tokens in this chunk
    double  ms;                     // wall time of the micro-step
    double  graph_mib;              // compute buffer the training graph planned (all devices)
    double  context_mib;            // training K/V cache, allocated bytes
    double  adapter_mib;            // shadow + served LoRA tensors
    double  optimizer_mib;          // AdamW moments + gradient accumulator
    double  walk_mib;               // exact-walk adjoint buffers gK, gV, allocated bytes (0: plain walk)
    int32_t refused_chunk_pos;      // -1 unless refused
    int32_t refused_chunk_tokens;
    double  refused_need_mib;
    double  refused_allowance_mib;
    char    message[512];           // what did not fit / what failed; "" when ok
    int32_t group_reply;            // shared-prefix group: the reply this chunk walked, G for the shared prefix; -1: no group
    double  aborted_had_ms;         // aborted: the time limit the step had (dream_set_step_abort); 0 unless aborted
    double  aborted_need_ms;        // aborted: the time it needed, estimated (computed so far + the rest as last measured)
    char    refused_device[48];     // the ggml device whose need exceeded its allowance ("" unless refused)
    int64_t rpc_bytes;              // bytes sent to and received from RPC workers during this call (0 without workers)
};

// One member of a struct as this library was compiled: a binding compares
// its own mirror of the struct with these, so a field added on one side only
// fails when the library loads instead of shifting every later field.
struct dream_field_layout {
    const char * name;      // the member's name in this header
    size_t       offset;    // offsetof(struct, member), bytes
    size_t       size;      // sizeof(member), bytes
};

// The members of struct dream_receipt in declaration order. Returns their
// count; *fields points at a static array owned by the library (never freed)
// and *struct_size is sizeof(struct dream_receipt). Either pointer may be NULL.
LLAMA_API int32_t dream_receipt_layout(const struct dream_field_layout ** fields, size_t * struct_size);

// The training cache types dream_params.context_cache_type accepts, comma
// separated in the order of preference ("q8_0,q4_0,f16,f32"); a static string.
LLAMA_API const char * dream_context_cache_types(void);

// Configuration of one dream stage (one training job on one context).
struct dream_params {
    int32_t      rank;                // LoRA rank (8)
    float        alpha;               // LoRA alpha (16); scale = alpha / rank
    const char * targets;             // comma list of attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down
    int32_t      top_layers;          // adapt only the last K blocks; <= 0: all
    uint32_t     seed;                // A init seed
    const char * context_cache_type;  // q8_0 | q4_0 | f16 | f32
    int32_t      window;              // tokens per window (training cache size)
    int32_t      chunk;               // tokens per micro-step
    bool         exact;               // exact walk: forward sweep, then a reverse pass carrying K/V adjoints (one update per window)
    bool         recompute;           // rematerialize each layer's activations in the backward (lower graph_mib, same gradient)
    int32_t      horizon;             // exact walk: only the last H positions before a chunk receive gradient; <= 0: all
    float        lr, beta1, beta2, eps, weight_decay;
    float        grad_clip;           // global L2 norm clip; <= 0: off
    int32_t      accumulate_windows;  // windows per AdamW update (1); their gradients are averaged
    double       memory_budget_mib;   // job budget; <= 0: unlimited (device free memory only)
    double       slack_mib;           // kept free on every device
};

// Defaults: rank 8, alpha 16, attn_q,attn_v, all layers, q8_0, window 512,
// chunk 128, lr 1e-4, betas 0.9/0.999, eps 1e-8, wd 0, clip 1, 1 window per update,
// no budget, slack 64.
LLAMA_API struct dream_params dream_default_params(void);

struct dream_stage;

// Creates the dream stage on ctx: validates params (a bad value is an error
// receipt naming it), then, through the memory gate, allocates the shadow and
// served adapters (A uniform +-1/sqrt(n_in), B zero, F32, on each weight's
// device), the training K/V cache and the optimizer state. Returns NULL with
// *receipt filled when refused or invalid. The stage borrows ctx; free it first.
LLAMA_API struct dream_stage * dream_init(struct llama_context * ctx, struct dream_params params,
                                          struct dream_receipt * receipt);

// Frees the stage, its adapters (detaching the served one from ctx if set) and its cache.
LLAMA_API void dream_free(struct dream_stage * ds);

// Starts a window: copies n tokens and their loss mask (mask[i] != 0 trains the
// prediction of tokens[i] from tokens[<i]; mask[0] is ignored). Clears the
// training cache, and the gradient accumulator when the previous window ended
// with an optimizer update. Returns DREAM_STATUS_OK, or ERROR with receipt->message.
LLAMA_API int32_t dream_window_begin(struct dream_stage * ds, const llama_token * tokens,
                                     const uint8_t * loss_mask, int32_t n, struct dream_receipt * receipt);

// Soft targets for the window just begun (call after dream_window_begin, before
// its first micro-step; the next dream_window_begin or dream_group_begin drops
// them): the prediction of the window's r-th loss token (in window order) is
// trained against the distribution of row r, probs[r*k + i] on token ids[r*k + i],
// instead of the one-hot of the token itself, for n_rows = the window's loss
// tokens rows of k pairs. A pair with id -1 pads a row (its probability must be
// 0); an id may repeat (its probabilities add). Each row's probabilities are
// finite, >= 0 and sum to at most 1 (within 1e-3, rescaled to 1 above it).
// What a row leaves out, rest = 1 - its sum, is the target's probability of
// every token outside the row together (a top-k record's tail), trained as one
// outcome: the window's loss is the mean over loss tokens of
// -sum_i p_i log q_i - rest log(sum of q over the tokens outside the row),
// KL(row and rest || model's same outcomes) + their entropy, and zero
// gradient where the model is the target. Rows that sum to 1 are plain
// cross-entropy (ggml's CROSS_ENTROPY_LOSS; with a rest, a node of ours that
// runs on the CPU backend). The labels are a dense [n_vocab, rows] matrix
// filled on the host. Returns DREAM_STATUS_OK, or ERROR with
// receipt->message naming the bad value (nothing changed).
LLAMA_API int32_t dream_window_soft_targets(struct dream_stage * ds, const int32_t * ids, const float * probs,
                                            int32_t k, int32_t n_rows, struct dream_receipt * receipt);

// One micro-step: the next chunk of the current window, forward (+ backward when
// it has loss tokens), gradient accumulated; at the last chunk of every
// accumulate_windows-th window one AdamW update of the shadow adapter with the
// windows' mean gradient. The exact walk first runs the chunks forward only
// (filling the cache), then walks them back from the last loss token, one
// backward chunk per call, carrying the K/V adjoints. Fills *receipt; returns
// its status. A refused chunk changes nothing and may be retried; in the
// exact walk's reverse pass a refusal also halves the horizon (in whole chunks,
// not below one) when that can shrink the graph, and the receipt says so.
LLAMA_API int32_t dream_micro_step(struct dream_stage * ds, struct dream_receipt * receipt);

// Starts a shared-prefix group (instead of a window): the prompt `prefix[n_prefix]`
// and n_replies replies, reply g being the next reply_lengths[g] tokens of
// reply_tokens with their loss mask (reply_mask[i] != 0 trains the prediction of
// that token; a reply's first token is predicted from the prompt's last) and
// weights[g] (any finite value, negative included). The group's loss is
// sum_g weights[g] * (mean CE over reply g's loss tokens) / n_replies: exactly
// the mean of n_replies separate windows (prompt + reply g), each window's loss
// multiplied by its weight. Micro-steps then run the prompt forward once, each
// reply as a child chunk (forward and backward against the prompt's K/V as
// gradient leaves, adjoints summed over replies), the prompt backward once, and
// count as one window for accumulate_windows. Replies never attend to one
// another. Needs n_prefix >= 1, every reply >= 1 loss token, n_prefix + the
// longest reply <= window, and no horizon. Returns DREAM_STATUS_OK, or ERROR
// with receipt->message naming the bad value.
LLAMA_API int32_t dream_group_begin(struct dream_stage * ds, const llama_token * prefix, int32_t n_prefix,
                                    const llama_token * reply_tokens, const uint8_t * reply_mask,
                                    const int32_t * reply_lengths, const float * weights, int32_t n_replies,
                                    struct dream_receipt * receipt);

// Copies the current (or last) group's per-reply losses into out[n] (mean CE over
// each reply's loss tokens, unweighted; NaN for a reply not walked yet).
// Returns the group's reply count (0: no group begun since the last window).
LLAMA_API int32_t dream_group_reply_losses(const struct dream_stage * ds, double * out, int32_t n);

// Chunks left in the current window (0: window done or none begun).
LLAMA_API int32_t dream_chunks_left(const struct dream_stage * ds);

// Number of trainable LoRA scalars (the length of dream_gradients/dream_parameters vectors).
LLAMA_API int64_t dream_n_params(const struct dream_stage * ds);

// Number of (layer, target) LoRA pairs, and pair i's shape: layer index, target
// name (static string), n_in, n_out. A is (rank, n_in) row-major, B is (n_out, rank).
LLAMA_API int32_t dream_n_pairs(const struct dream_stage * ds);
LLAMA_API bool    dream_pair_info(const struct dream_stage * ds, int32_t i, int32_t * layer,
                                  const char ** target, int64_t * n_in, int64_t * n_out);

// Copies the accumulated gradient (the sum over the windows since the last
// update, including a finished window) into out[n_params], canonical order:
// pairs in order, A then B, row-major. Returns false if n is short.
LLAMA_API bool dream_gradients(const struct dream_stage * ds, float * out, int64_t n);

// Copies (get) or overwrites (set) the shadow adapter's parameters, same order.
LLAMA_API bool dream_get_parameters(const struct dream_stage * ds, float * out, int64_t n);
LLAMA_API bool dream_set_parameters(struct dream_stage * ds, const float * in, int64_t n);

// Copies the AdamW state into out[2*n_params] (first moments, then second); returns the update count.
LLAMA_API int64_t dream_optimizer_state(const struct dream_stage * ds, float * out, int64_t n);

// Overwrites the AdamW state from in[2*n_params] (as dream_optimizer_state gives it) and
// sets the update count to t; the gradient accumulator is zeroed. For a trainer made again
// on a reloaded model (a checkpoint taken between windows). Allocates the optimizer state
// if no update made it yet (3 * n_params floats, what the first update would take).
// False if n is not 2*n_params, t < 0, or a window's gradient awaits an update.
LLAMA_API bool dream_set_optimizer_state(struct dream_stage * ds, const float * in, int64_t n, int64_t t);

// Copies shadow -> served (call between decode batches). Returns the new served version (1, 2, ...).
LLAMA_API int64_t dream_promote(struct dream_stage * ds);

// The served adapter as an ordinary llama_adapter_lora (owned by the stage) for
// llama_set_adapters_lora; its scale 1.0 gives the LoRA scale alpha/rank.
LLAMA_API struct llama_adapter_lora * dream_served_adapter(struct dream_stage * ds);

// Replaces the job's memory budget (MiB; <= 0: unlimited). Takes effect at the next micro-step.
LLAMA_API void dream_set_budget(struct dream_stage * ds, double memory_budget_mib);

// What the job holds now against its budget (MiB): adapters, training cache, the
// exact walk's buffers, optimizer state, the training graphs' buffers and the
// device pools' kept expansion. The gate's allowance is budget - this - slack.
LLAMA_API double dream_held_mib(const struct dream_stage * ds);

// One device's figures in the last gate check (dream_init's or a micro-step's), MiB.
struct dream_gate_device {
    char   device[48];      // the ggml device name ("CPU", "CUDA0", "RPC0", ...)
    double need_mib;        // what that check would have added there
    double allowance_mib;   // min(budget left, device free) - slack, never negative
};

// Writes up to n of the last gate check's devices (ggml's device order) to out
// and returns how many it checked; 0 before the first check.
LLAMA_API int32_t dream_gate_devices(const struct dream_stage * ds, struct dream_gate_device * out, int32_t n);

// Sets the exact walk's horizon (positions before a chunk that receive gradient;
// <= 0: the whole window) from the next micro-step on. Returns the horizon now
// in use, or -1 (nothing changed) for a plain-walk stage.
LLAMA_API int32_t dream_set_horizon(struct dream_stage * ds, int32_t horizon);

// Replaces the chunk (tokens per micro-step, 1..window) from the next micro-step on,
// e.g. after a refusal (the chunk ladder). The walk's position, the gradient
// accumulated in the current window and the optimizer state are kept: a chunk
// only bounds how many tokens the next graph takes. Returns false (nothing
// changed) for a value out of range.
LLAMA_API bool dream_set_chunk(struct dream_stage * ds, int32_t chunk);

// Replaces AdamW's learning rate from the next optimizer update on (a schedule
// the caller runs: the rehearsal-only epochs' step falling to 0). The moments
// do not depend on it. Returns false (nothing changed) for a negative or
// non-finite value.
LLAMA_API bool dream_set_lr(struct dream_stage * ds, float lr);

// Scheduler splits of the stage's last computed training graph (0 before the
// first). 1 means the whole graph ran on one backend; with every layer on a
// GPU, 2 means only the host-side input reads (the token embedding) ran apart.
LLAMA_API int32_t dream_last_n_splits(const struct dream_stage * ds);

// Whether the stage's last micro-step could have stopped at a step deadline
// (dream_set_step_deadline), whether or not one was set: a plain-walk chunk (no
// reverse pass, no group reply) whose graph ran wholly on the CPU backend. False
// before the first step. The pacer reads it to know whether the deadline alone
// bounds a step's pause or the chunk has to be cut.
LLAMA_API bool dream_last_step_stoppable(const struct dream_stage * ds);

// Graph reuse (on by default): a plain-walk micro-step whose chunk has the
// last step's shape (position, tokens, loss rows) computes the graph that step
// built and allocated, instead of building, planning and allocating it again.
// Off: every step builds its own (the reference for tests and benchmarks).
// dream_graph_reuses counts the micro-steps that reused a graph.
LLAMA_API void dream_set_graph_reuse(struct dream_stage * ds, bool on);
LLAMA_API int64_t dream_graph_reuses(const struct dream_stage * ds);

// Whether the stage's training graphs run attention fused (FLASH_ATTN_EXT and
// the dream stage's backward for it, on CUDA) instead of as explicit products:
// decided at dream_init, true when every layer's attention runs on CUDA with a
// head size of 64 or 128, unless DREAMSTAGE_FUSED_ATTN=0 or NVIDIA_TF32_OVERRIDE=0.
LLAMA_API bool dream_fused_attention(const struct dream_stage * ds);

// Whether the gradient accumulator and AdamW's state live on the adapter's
// device (decided at dream_init: true when every A and B lies on one GPU, or
// on several devices: then each device keeps its own tensors' state) instead
// of the host. DREAMSTAGE_OPTIMIZER=host keeps them on the host;
// =device puts them on the adapter's backend even when that is the CPU.
LLAMA_API bool dream_optimizer_on_device(const struct dream_stage * ds);

// A deadline for the micro-steps that follow (the pacer's pause bound). A step
// whose graph runs wholly on the CPU backend is then computed in segments of
// nodes; one still running `ms` after the step began stops between two
// segments and returns DREAM_STATUS_STOPPED, keeping everything it computed:
// the next dream_micro_step goes on from there (with a deadline of its own)
// and completes the chunk. A call that changes what the step computes drops
// the stopped part first (dream_window_begin, dream_group_begin, a new chunk,
// dream_set_horizon, dream_set_parameters, graph reuse off): the chunk's cache
// cells are reverted and it starts again. Only steps whose graph writes nothing
// but the chunk's own cache cells stop (the plain walk, the exact walk's forward
// sweep); a reverse-pass chunk and a group's chunks always finish, as does a
// graph with a GPU in it. ms <= 0: no deadline (the default).
LLAMA_API void dream_set_step_deadline(struct dream_stage * ds, double ms);

// A hard time limit for the micro-steps that follow, later than the deadline
// (a segment begun before the deadline may run past it on a crowded machine).
// A step that could stop at the deadline (see above) and is still computing `ms`
// after it began is aborted between two graph nodes through the CPU backend's
// abort callback and undone: its cache cells reverted, a stopped part dropped,
// nothing accumulated, the walk where it was. It returns DREAM_STATUS_ABORTED
// with aborted_had_ms and aborted_need_ms; the next micro-step starts the chunk
// again. Steps that cannot stop, and graphs with a GPU in them, are never
// aborted. ms <= 0: no limit (the default).
LLAMA_API void dream_set_step_abort(struct dream_stage * ds, double ms);

// Bytes of serving's compute buffers on ctx, all devices. Training graphs run
// on the stage's own schedulers, so a micro-step or a refusal never changes it.
LLAMA_API size_t dream_serving_compute_bytes(struct llama_context * ctx);

// The adapter bank: GGUF LoRA adapters resident beside the base model for
// serving, each in a slot, applied per token so that one decode batch can hold
// sequences on different adapters and on the base. Every adapted weight keeps
// all slots' A and B stacked (F32, padded to max_rank, each slot's scale folded
// into B) on that weight's device; a decode the bank was armed for adds each
// token's B A x, gathered by GGML_OP_MUL_MAT_ID or, on a GPU, by a one-hot
// mask over every slot's product (DREAMSTAGE_BANK_GATHER, dream-bank.cpp).
// One bank per context; it never enters training graphs, and a decode it was
// not armed for is unchanged.
struct dream_bank;

// Creates ctx's bank with `capacity` slots (1..1024) for adapters of rank up to
// max_rank (1..4096). Allocates nothing yet: a weight's stack is allocated when
// the first adapter that adapts it loads. Returns NULL with err (err_size bytes,
// may be NULL) naming the bad value, or when ctx already has a bank. Free the
// bank before ctx.
LLAMA_API struct dream_bank * dream_bank_init(struct llama_context * ctx, int32_t capacity, int32_t max_rank,
                                              char * err, size_t err_size);

// Frees the bank's stacks; serving's next decode builds its graph afresh.
LLAMA_API void dream_bank_free(struct dream_bank * bank);

// Loads the GGUF LoRA at path (llama.cpp's loader: format, architecture and
// shapes checked) into the lowest free slot with user scale `scale` (the
// term is scale * alpha / rank * B A x, as llama_set_adapters_lora applies it).
// Returns the slot, or -1 with err naming the file and what is wrong (a full
// bank, a rank above max_rank, a failed allocation); a refusal changes nothing
// that serves. Call between decodes.
LLAMA_API int32_t dream_bank_load(struct dream_bank * bank, const char * path, float scale, char * err, size_t err_size);

// Empties a slot (its factors zeroed, tokens armed on it fall back to the base)
// for a later load. Returns false for a slot that holds no adapter. Call between decodes.
LLAMA_API bool dream_bank_unload(struct dream_bank * bank, int32_t slot);

// Arms the bank for the decodes that follow: slots[i] is the adapter slot of
// the i-th token of the llama_batch passed to llama_decode (-1: the base
// model), n its token count. Holds until the next call; n == 0 or every slot
// -1 disarms (decodes run exactly as without a bank). Returns false with err
// naming the token when a slot holds no adapter (nothing changed).
LLAMA_API bool dream_bank_set_token_adapters(struct dream_bank * bank, const int32_t * slots, int32_t n,
                                             char * err, size_t err_size);

// Bytes one loaded slot takes in the bank's stacks (0 for an empty slot).
LLAMA_API size_t dream_bank_slot_bytes(const struct dream_bank * bank, int32_t slot);

// Bytes of every stack the bank allocated, all slots and devices.
LLAMA_API size_t dream_bank_total_bytes(const struct dream_bank * bank);

#ifdef __cplusplus
}
#endif
