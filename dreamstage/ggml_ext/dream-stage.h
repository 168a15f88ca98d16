// The dream stage's C++ state, shared by dream-*.cpp (never by Python).
#pragma once

#include "dream.h"
#include "dream-hooks.h"
#include "dream-switches.h"

#include "ggml-cpu.h"

#include "llama-adapter.h"
#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

// Private members of llama_context that the dream stage reads (the scheduler,
// cparams, adapters, graph-reuse state). llama-context.h befriends this struct
// (vendor patch 0001); it is the only door into those members.
struct dream_context_access {
    static const llama_cparams & cparams(const llama_context & c) { return c.cparams; }
    static const llama_adapter_cvec * cvec(const llama_context & c) { return c.cvec.get(); }
    static llama_adapter_loras * loras(llama_context & c) { return c.loras.get(); }
    static const llama_cross * cross(const llama_context & c) { return &c.cross; }
    static ggml_backend_t backend_cpu(const llama_context & c) { return c.backend_cpu; }
    // the CPU threadpool and thread counts serving's graph_compute would use
    // (batched: the prompt-batch settings), applied before a training graph runs
    static void set_compute_threads(llama_context & c, bool batched) {
        if (c.backend_cpu != nullptr) {
            auto * reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(c.backend_cpu));
            auto * set_tp = (decltype(ggml_backend_cpu_set_threadpool) *) ggml_backend_reg_get_proc_address(
                reg, "ggml_backend_cpu_set_threadpool");
            if (set_tp) {
                set_tp(c.backend_cpu, batched ? c.threadpool_batch : c.threadpool);
            }
        }
        const int n = batched ? c.cparams.n_threads_batch : c.cparams.n_threads;
        for (const auto & [backend, set_n_threads] : c.set_n_threads_fns) {
            set_n_threads(backend, n);
        }
    }
    // the CPU backend's abort callback: the stage's own while a training graph
    // runs (cb), serving's again after (cb null: llama_set_abort_callback's)
    static void set_cpu_abort(llama_context & c, ggml_abort_callback cb, void * data) {
        if (c.backend_cpu == nullptr) {
            return;
        }
        auto * reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(c.backend_cpu));
        auto * set_abort = (ggml_backend_set_abort_callback_t) ggml_backend_reg_get_proc_address(
            reg, "ggml_backend_set_abort_callback");
        if (set_abort) {
            set_abort(c.backend_cpu, cb ? cb : c.abort_callback, cb ? data : c.abort_callback_data);
        }
    }
    // removes an adapter the stage is about to free from serving's set
    static void detach_lora(llama_context & c, llama_adapter_lora * a) {
        if (c.loras && c.loras->erase(a)) {
            c.sched_need_reserve = true;
        }
    }
    // makes the next decode build its graph instead of reusing the last one
    // (the adapter bank changed what the graph must hold)
    static void forget_graph(llama_context & c) { c.gf_res_prev_active = nullptr; }
};

// ggml_backend_sched_free as a unique_ptr deleter
struct dream_sched_deleter {
    void operator()(ggml_backend_sched * s) const;
};
using dream_sched_ptr = std::unique_ptr<ggml_backend_sched, dream_sched_deleter>;

enum dream_target { DT_ATTN_Q, DT_ATTN_K, DT_ATTN_V, DT_ATTN_OUT, DT_FFN_GATE, DT_FFN_UP, DT_FFN_DOWN, DT_COUNT };

// Target names as they appear in the request and in GGUF tensor names.
extern const char * const dream_target_names[DT_COUNT];

// One adapted weight: shadow (trained) and served copies of A and B.
struct dream_pair {
    int32_t       layer;
    dream_target  target;
    ggml_tensor * weight;   // the frozen base weight (model-owned)
    int64_t       n_in, n_out;
    ggml_tensor * a_shadow, * b_shadow;  // A: ne = [n_in, rank], B: ne = [rank, n_out]
    ggml_tensor * a_served, * b_served;
};

// A shared-prefix group in progress (dream-groups.cpp): the prompt's first
// `shared` = n_prefix - 1 cells are run forward once and backward once; each
// reply is a child window [shared, n_prefix + len) that re-reads the prompt's
// last token (its row predicts the reply's first token, a different target per
// reply) and sends its adjoints into the shared cells' gK/gV.
struct dream_group_state {
    bool    active = false;
    int32_t n_prefix = 0;
    int32_t shared = 0;                           // n_prefix - 1
    std::vector<llama_token> prefix;
    std::vector<std::vector<llama_token>> reply_tokens;
    std::vector<std::vector<uint8_t>> reply_mask;  // per reply token: trains its prediction
    std::vector<float> weights;
    std::vector<double> reply_loss;               // mean CE over each reply's loss tokens (unweighted)
    int32_t reply = 0;                            // the reply being walked; == G: the shared prefix's reverse pass
};

// One micro-step's chunk [p, p + n) of the window, and what its graph carries.
struct dream_chunk {
    int32_t p = 0, n = 0;
    bool    backward_pass = false;  // exact walk / group: a reverse-pass chunk (backward even without loss rows)
    int32_t leaf_lo = -1;           // exact walk / group: cells [leaf_lo, p) are gradient leaves; -1: none
    bool    surrogate = false;      // exact walk / group: later chunks left adjoints on this chunk's cells
    int32_t group_reply = -1;       // group: the reply this chunk belongs to, G for the shared prefix; -1: no group
};

using dream_deadline_t = std::chrono::steady_clock::time_point;

// A micro-step stopped at its deadline (dream_set_step_deadline): its graph
// stays allocated in dream_exec_state::step_graph, and the next micro-step computes
// it on from next_node. Anything that changes what the step computes drops it
// first (dream_suspended_drop: its cells reverted, the graph freed).
struct dream_suspended_step {
    bool    active = false;
    int32_t next_node = 0;          // the first graph node not computed
    dream_chunk chunk;
    int32_t n_loss = 0;
    bool    train = false, keepable = false, reuse = false, need_opt_state = false, batched = false;
    double  graph_mib = 0;
};

// The last micro-step's training graph, left allocated on the exec scheduler
// (dream-step.cpp). The next chunk of the same shape (position, tokens, loss
// rows, loss scale; the plain walk only) sets its inputs and computes it again:
// no build, no plan, no allocation. ggml-opt keeps its graphs for the same
// reason. Whatever else runs on the exec scheduler drops it first.
struct dream_step_graph {
    bool valid = false;
    int32_t p = 0, n = 0, n_out = 0;
    bool train = false;
    bool soft = false;                    // its labels are host-filled soft targets (dream-soft.cpp)
    bool soft_rest = false;               // ... and its loss counts their rest (dream_soft_rest_ce)
    float loss_scale = 0.0f;
    ggml_context_ptr ctx;                 // the backward graph's tensors (the forward's live in dream_exec_state::res)
    ggml_cgraph * gb = nullptr;
    ggml_tensor * target_ids = nullptr, * host_labels = nullptr, * ce = nullptr, * loss_grad = nullptr;
    ggml_tensor * host_rest = nullptr;    // the loss rows' rest masses, with soft_rest
    ggml_tensor * unit = nullptr;         // dream_unit's input, when the graph has one
    std::vector<ggml_tensor *> param_grads;
    std::vector<std::pair<ggml_backend_dev_t, size_t>> pool_need;
    size_t graph_bytes = 0;               // what the plan measured, for the receipts
};

// The optimizer's state on the adapter's device (dream-optim.cpp): per A and
// B tensor its accumulator and moments, and the update's scalar inputs.
struct dream_device_opt {
    ggml_backend_t backend = nullptr;     // serving's backend of that device
    ggml_context_ptr ctx;
    ggml_backend_buffer_ptr buf;          // null until the first training step
    std::vector<ggml_tensor *> acc, m, v; // per A and B tensor of the stage; null for those on other devices
    ggml_tensor * grad_scale = nullptr, * adamw_params = nullptr;
    ggml_gallocr_ptr galloc;              // intermediates of the optimizer's small graphs
    std::vector<uint8_t> arena;           // their metadata
};

// The adapters (dream-adapter.cpp): shadow (trained) and served copies.
struct dream_lora_state {
    std::unique_ptr<llama_adapter_lora> shadow, served;
    llama_adapter_loras shadow_set;   // {shadow: 1.0}, given to training graphs only
    std::vector<dream_pair> pairs;
    int64_t n_params      = 0;
    size_t  bytes         = 0;
    int64_t served_version = 0;
};

// The optimizer (dream-optim.cpp), canonical order: the accumulator and AdamW's
// moments as host F32 vectors, or on the adapter's GPU (device.backend set).
struct dream_opt_state {
    std::vector<float> grad_acc, adam_m, adam_v;
    // one per device holding A and B tensors (each steps its own); empty: the host optimizer
    std::vector<dream_device_opt> devices;
    int64_t adam_t = 0;
    int32_t windows_pending = 0;   // finished windows whose gradient awaits an update
};

// The training memory (dream-memory.cpp allocates, dream-step.cpp uses).
struct dream_train_memory {
    std::unique_ptr<llama_kv_cache> cache;
    size_t context_bytes = 0;
    // the exact walk's F32 adjoint buffers gK, gV per layer, ne = [head_dim,
    // n_head_kv, adj_rows] like the cache's rows (position q in slot q % adj_rows),
    // on the layer's device; null for layers without K/V. Empty until the first backward chunk.
    std::vector<ggml_tensor *> adj_k, adj_v;
    int32_t adj_rows = 0;
    std::vector<ggml_context_ptr> adj_ctxs;
    std::vector<ggml_backend_buffer_ptr> adj_bufs;
    size_t walk_bytes = 0;
    int32_t horizon = 0;            // ancestors (positions) that receive gradient; 0: the whole window
    int32_t chunk_max = 0;          // the largest chunk set so far (sizes the adjoint slots with a horizon)
};

// The walk's position in the current window, and what its loss reads.
struct dream_window {
    std::vector<llama_token> tokens;
    std::vector<uint8_t>     mask;
    int32_t pos      = 0;   // next chunk's first position
    int32_t n        = 0;
    int32_t n_masked = 0;   // loss tokens in the whole window
    bool    active   = false;
    // exact walk: the forward sweep fills the cache up to where the reverse
    // pass starts; the reverse pass then walks [0, rev_end) back to 0
    bool    reverse  = false;
    int32_t loss_end = 0;       // inputs [0, loss_end) feed every loss token
    int32_t rev_end  = 0;       // the reverse pass's next chunk ends here
    std::vector<uint8_t> adj;   // per position: an adjoint was added to gK/gV
    // the loss multiplier: 1, or a group reply's weight (dream-groups.cpp)
    float loss_scale = 1.0f;
    // soft targets (dream-soft.cpp): soft_k (id, probability) pairs per loss token,
    // the row of window position j at soft_row[j]; k 0: one-hot
    int32_t soft_k = 0;
    std::vector<int32_t> soft_ids;
    std::vector<float>   soft_p;
    std::vector<int32_t> soft_row;
    // per row, the mass its pairs leave out (1 - their sum): the target's probability of
    // every other token together, trained as one outcome (dream_soft_rest_ce); all zero: none
    std::vector<float>   soft_rest;
};

// The stage's own schedulers and what stays allocated on them between micro-steps (dream-sched.cpp).
struct dream_exec_state {
    dream_sched_ptr sched_plan, sched_exec;   // plan measures, exec allocates and computes
    size_t  sched_capacity = 0;    // graph size both were made for
    std::vector<uint8_t> twin_arena;   // metadata of the graph twin the plan measures
    int32_t last_n_splits  = 0;    // scheduler splits of the last computed training graph
    bool    last_one_cpu_split = false;   // that graph ran wholly on the CPU backend, one split (so it can be segmented)
    bool    last_step_stoppable = false;  // dream_last_step_stoppable
    // bytes each device's ggml-cuda pool already grew to for quantized OUT_PROD expansions
    std::vector<std::pair<ggml_backend_dev_t, size_t>> pool_held;
    std::unique_ptr<llm_graph_result> res;  // training graph storage, rebuilt unless the step graph is reused
    dream_step_graph step_graph;
    std::vector<dream_gate_device> last_gate;   // the last gate check, per device (dream_gate_devices)
    bool    graph_reuse  = true;    // dream_set_graph_reuse
    int64_t graph_reuses = 0;       // micro-steps that reused the step graph
    double  step_deadline_ms = 0;   // dream_set_step_deadline; <= 0: none
    double  step_abort_ms = 0;      // dream_set_step_abort; <= 0: none
    bool    aborted = false;        // the last segmented compute was aborted inside a segment (abort callback)
    double  aborted_need_ms = 0;    // ... and the time the step needed, estimated
    dream_suspended_step suspended; // a step stopped at its deadline, continued by the next micro-step
    // per graph shape, how long each segment took when it last ran: a segment
    // predicted to end past the deadline is not begun
    std::unordered_map<uint64_t, std::vector<float>> segment_ms;
};

// Set while a training graph is being built (read by the attention hook).
struct dream_build_state {
    int32_t pos = 0;
    ggml_tensor * unit = nullptr;   // the unit scalar input of dream_join_prefix
    int32_t leaf_lo = -1;           // exact walk: cells [lo, pos) are gradient leaves; -1: none
    bool surrogate = false;         // exact walk: add sum(k*gK) + sum(v*gV) of the chunk's own K/V
    std::vector<ggml_tensor *> leaf_k, leaf_v;   // per layer, the leaves built (or null)
    ggml_tensor * sur = nullptr;    // the surrogate's sum over layers
};

struct dream_stage {
    llama_context     * lctx  = nullptr;
    llama_model       * model = nullptr;
    dream_params        params{};
    std::string         targets_str, cache_type_str;
    ggml_type           cache_type = GGML_TYPE_Q8_0;
    dream_switches      switches;   // read at dream_init (dream-switches.h)
    bool                fused_attn = false;   // training graphs use FLASH_ATTN_EXT and its backward (dream-fattn.cpp)
    int64_t             step = 0;

    dream_lora_state   lora;
    dream_opt_state    opt;
    dream_train_memory mem;
    dream_window       win;
    dream_group_state  group;
    dream_exec_state   exec;
    dream_build_state  build;
};

// The CPU device: where host memory (the host optimizer, host buffers) is counted; null: none.
inline ggml_backend_dev_t dream_host_device() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            return d;
        }
    }
    return nullptr;
}

// The device memory of this buffer type lives on. Host memory is the host's: ggml-cpu's buffer
// type names no device, and a GPU backend's pinned host buffers (CUDA_Host) name the GPU.
inline ggml_backend_dev_t dream_buft_device(ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_is_host(buft) ? dream_host_device() : ggml_backend_buft_get_device(buft);
}

// dream-adapter.cpp
bool dream_adapter_create(dream_stage & ds, std::string & err);
// Where a LoRA for weight w lives: the weight's device, in its default buffer type.
ggml_backend_buffer_type_t dream_lora_buft(const ggml_tensor * w);
void dream_adapter_copy(dream_stage & ds, bool shadow_to_served);
bool dream_adapter_read(const dream_stage & ds, bool shadow, float * out);
void dream_adapter_write(dream_stage & ds, const float * in);
size_t dream_adapter_bytes_planned(const dream_stage & ds);
bool dream_plan(dream_stage & ds, std::string & err);  // resolves targets/layers, no allocation

// dream-optim.cpp: the gradient accumulator and AdamW, on the host or the adapter's GPU
void   dream_opt_choose(dream_stage & ds);            // after the adapter exists: where the state lives
bool   dream_opt_on_device(const dream_stage & ds);
bool   dream_opt_ready(const dream_stage & ds);       // the state exists (from the first training step)
size_t dream_opt_bytes(const dream_stage & ds);       // what the state holds now
// a micro-step's memory besides its graph: the state at the first training
// step, and on the host the copy of one step's gradients
std::vector<std::pair<ggml_backend_dev_t, size_t>> dream_opt_step_needs(const dream_stage & ds, bool train);
bool   dream_opt_create(dream_stage & ds);
bool   dream_opt_accumulate(dream_stage & ds, const std::vector<ggml_tensor *> & grads);   // canonical order; null: none
void   dream_opt_zero_acc(dream_stage & ds);
// Overwrites the first (which 1) or second (2) moments from in[n_params], canonical order; the state exists.
void   dream_opt_write(dream_stage & ds, int which, const float * in);
void   dream_opt_scale_acc(dream_stage & ds, float mul, float div);   // acc = acc * mul / div
bool   dream_opt_update(dream_stage & ds);            // AdamW on the mean of the pending windows' gradient
void   dream_opt_read(const dream_stage & ds, int which, float * out);   // 0: accumulator, 1: m, 2: v

// dream-memory.cpp
bool dream_cache_type_from_name(const char * name, ggml_type & out);
size_t dream_memory_bytes_planned(const dream_stage & ds);
bool dream_memory_create(dream_stage & ds, std::string & err);
// the exact walk's adjoint buffers of `rows` slots: bytes per device, create (zeroed), free, zero
std::vector<std::pair<ggml_backend_dev_t, size_t>> dream_walk_bytes_planned(const dream_stage & ds, int32_t rows);
bool dream_walk_create(dream_stage & ds, int32_t rows, std::string & err);
void dream_walk_free(dream_stage & ds);
void dream_walk_clear(dream_stage & ds);

// dream-gate.cpp: per-device comparison of need against allowance.
struct dream_gate_verdict {
    bool   fits = true;
    double need_mib = 0, allowance_mib = 0;   // the allowance is never negative
    std::string device;
    std::string why;   // set when the allowance is 0 because the budget or the device has nothing left: "; ..." for a message
};
// Records each device's figures in ds.exec.last_gate.
dream_gate_verdict dream_gate_check(dream_stage & ds,
                                    const std::vector<std::pair<ggml_backend_dev_t, size_t>> & needs);
double dream_held_mib(const dream_stage & ds);   // what the job holds now (the optimizer's state included)

// dream-soft.cpp: soft targets of a plain window (dream_window_soft_targets)
void dream_soft_clear(dream_stage & ds);
bool dream_soft_active(const dream_stage & ds);
// writes the label rows of a chunk at p (targets[i] >= 0: input p+i has a loss row) into
// lab[rows][n_vocab], each the soft target of the token it predicts, and with rest (not null) each
// row's rest mass into rest[rows]
void dream_soft_fill(const dream_stage & ds, int32_t p, const std::vector<int32_t> & targets, float * lab,
                     int64_t n_vocab, float * rest);
// whether the window's soft rows leave mass out (their loss is then dream_soft_rest_ce's)
bool dream_soft_has_rest(const dream_stage & ds);
// The mean over rows of -sum_i lab_i log q_i - rest log(sum of q_j over the tokens j the row's labels
// leave at 0), q = softmax(logits): the soft targets' cross-entropy with their rest as one outcome.
// logits and labels [n_vocab, rows] F32, rest [rows] F32; a scalar with its own backward (the hook below)
ggml_tensor * dream_soft_rest_ce(ggml_context * ctx, ggml_tensor * logits, ggml_tensor * labels, ggml_tensor * rest);
// ggml's backward builder: the gradient of a dream_soft_rest_ce node's rows; false for any other node
bool dream_soft_rest_backward(ggml_context * ctx, ggml_tensor * t, ggml_tensor * grad, ggml_tensor ** out);
bool dream_is_soft_rest_ce(const ggml_tensor * t);

// dream-receipt.cpp
void dream_receipt_start(const dream_stage & ds, dream_receipt & r);
void dream_receipt_message(dream_receipt & r, const char * fmt, ...);
void dream_receipt_refused(dream_receipt & r, int32_t pos, int32_t tokens, const dream_gate_verdict & v);
// RPC workers (dream-rpc.cpp): bytes sent and received so far by this process, and
// connections that failed so far (endpoint of the last one in *last); 0 without the RPC backend.
uint64_t dream_rpc_bytes();
uint64_t dream_rpc_failures(std::string * last = nullptr);
// Whether a backend of the scheduler is an RPC worker's device.
bool dream_sched_has_rpc(ggml_backend_sched_t sched);
// The SwiGLU backward of the graphs built next on this thread: fused (one custom
// op, dream-glu.cpp; the default) or ggml's own ops. A graph with an RPC worker
// keeps ggml's: a custom op runs locally, and its inputs would cross the wire.
void dream_fused_glu_set(bool on);

// dream-recompute.cpp: the combined graph with layer activations rematerialized
// in the backward from the layers' outputs; null with err when it cannot apply.
// n_forward: the graph's first n_forward nodes are the forward pass (and loss).
ggml_cgraph * dream_recompute(ggml_context * ctx, ggml_cgraph * gb, int n_forward, size_t cap, std::string & err);

// dream-sched.cpp
struct dream_graph_plan {
    size_t graph_bytes = 0;   // compute buffers the graph plans, all devices
    int32_t n_splits = 0;     // scheduler splits of the plan
    std::vector<std::pair<ggml_backend_dev_t, size_t>> needs;   // growth of the stage's own buffers, per device
};
bool   dream_sched_ensure(dream_stage & ds, size_t graph_size);   // makes plan/exec for graphs up to graph_size
bool   dream_sched_plan(dream_stage & ds, ggml_cgraph * g, dream_graph_plan & plan);   // measures a twin of g
// Allocates g on the exec scheduler (unless `allocated`: still allocated from an
// earlier step, no second allocation), sets its inputs (when given) and computes it. With a deadline and next_node (the first node to
// compute), a graph wholly on the CPU backend runs in segments and stops
// between two once the deadline passed: GGML_STATUS_ABORTED, *next_node the
// first node not computed (dream_set_step_deadline). With abort_at too, a segment
// still running then is aborted between two nodes: GGML_STATUS_ABORTED with
// ds.exec.aborted set, the graph's results partial (dream_set_step_abort).
ggml_status dream_sched_compute(dream_stage & ds, ggml_cgraph * g, bool batched, bool allocated,
                                const std::function<void()> & set_inputs, const dream_deadline_t * deadline = nullptr,
                                int32_t * next_node = nullptr, const dream_deadline_t * abort_at = nullptr);
void dream_step_graph_drop(dream_stage & ds);
void dream_suspended_drop(dream_stage & ds);   // forgets a stopped step: its cells reverted, its graph freed
void   dream_sched_release(dream_stage & ds);         // ends the exec scheduler's use of the last graph
size_t dream_sched_held_bytes(const dream_stage & ds); // the exec scheduler's compute buffers, all devices

// dream-cpu-backward.cpp: dx = W^T dy for a frozen quantized W on the CPU, no F32 copy of W
bool dream_cpu_wt_dy_supported(const ggml_tensor * w, const ggml_tensor * dy);
ggml_tensor * dream_cpu_wt_dy(ggml_context * ctx, ggml_tensor * w, ggml_tensor * dy);   // [n_in, n_tok] F32

// dream-cpu-out-prod.cpp: a training graph's F32 OUT_PROD as a register-tiled CPU kernel
void dream_take_op(ggml_tensor * n, const ggml_tensor * k);   // n computes k's op on k's sources (keeps n's users)
bool dream_cpu_avx512();   // AVX-512: the widest CPU kernels of dream-cpu-*.cpp (others have AVX2 versions or keep ggml's ops)
bool dream_cpu_avx2();     // AVX2 and FMA: the 8-lane tiles of the backward and the F32 OUT_PROD
bool dream_cpu_out_prod_supported(const ggml_tensor * n);
void dream_cpu_out_prod_rewrite(ggml_context * ctx, ggml_tensor * n);   // n becomes the kernel's op in place
// dream-cpu-exp.cpp: CROSS_ENTROPY_LOSS and SILU_BACK with a vectorized exp, in place
bool dream_cpu_exp_ops_rewrite(ggml_context * ctx, ggml_tensor * n);
// SwiGLU's backward over n plain floats with the same vectorized exp (false: no AVX-512, nothing written)
bool dream_cpu_swiglu_back(const float * dy, const float * g, const float * u, float * dg, float * du, int64_t n);
// dream-cpu-rows.cpp: a host GET_ROWS of at least DREAM_GET_ROWS_MIN rows (the token
// embeddings) on every CPU thread (ggml-cpu runs the op as one task), in place
constexpr int64_t DREAM_GET_ROWS_MIN = 32;
bool dream_cpu_get_rows_rewrite(ggml_context * ctx, ggml_tensor * n);

// dream-step.cpp: one micro-step; dream-walk.cpp: the chunks left in the window (an upper bound)
int32_t dream_walk_micro_step(dream_stage & ds, dream_receipt & r);
int32_t dream_walk_chunks_left(const dream_stage & ds);

// dream-window.cpp: the reverse pass's bookkeeping (the walk's and the group's)
int32_t dream_loss_rows(const dream_stage & ds, int32_t p, int32_t e);     // rows in [p, e) whose next token carries loss
bool    dream_has_adjoint(const dream_stage & ds, int32_t p, int32_t e);   // an adjoint was added on [p, e)
// The reverse pass's chunk [start, end): marks the window reversed (rev_end = end)
// and fills c's position, size, backward flag and surrogate; leaf_lo is the caller's.
void    dream_reverse_chunk(dream_stage & ds, dream_chunk & c, int32_t start, int32_t end);

// dream-groups.cpp: the shared-prefix group's walk (the micro-step calls these while group.active)
dream_chunk dream_group_next_chunk(dream_stage & ds);
bool    dream_group_chunk_done(dream_stage & ds, const dream_chunk & c, const dream_receipt & r);   // true: group done
int32_t dream_group_chunks_left(const dream_stage & ds);

constexpr double DREAM_MIB = 1024.0 * 1024.0;

// dream-fattn.cpp: fused attention in training graphs on CUDA
bool dream_fattn_usable(const dream_stage & ds);          // every layer's attention on CUDA (installs the backward hook)
bool dream_fattn_differentiable(const ggml_tensor * t);   // a FLASH_ATTN_EXT node the hook differentiates
bool dream_fattn_on_cuda(ggml_backend_sched_t sched, ggml_cgraph * g);   // every fused backward node placed on CUDA
// the backward dream-fattn.cpp gives a FLASH_ATTN_EXT it differentiates (false for any other op)
bool dream_fattn_backward(ggml_context * ctx, ggml_tensor * t, ggml_tensor * grad, ggml_tensor ** out);

// dream-glu.cpp: SwiGLU's backward as one node (installs ggml's backward hooks when the library loads)
bool dream_is_swiglu_back(const ggml_tensor * t);
// dream-custom.cpp: a GGML_OP_CUSTOM node of ours: its op params carry DREAM_CUSTOM_TAG and `kind` (dream-hooks.h)
ggml_tensor * dream_custom_tagged(ggml_tensor * node, int32_t kind);
bool dream_is_custom(const ggml_tensor * t, int32_t kind);
