// The token embeddings' row gather of a training graph, on every CPU thread.
//
// llama keeps the token embeddings in host memory even with every layer
// offloaded, so a training graph's GET_ROWS (one row per token of the chunk)
// runs on the CPU backend, and ggml-cpu gives that op one task whatever the
// thread count (ggml-cpu.c: n_tasks = 1 for GET_ROWS, which suits serving's
// decode of a few tokens). A 2048-token chunk of a Llama-3.2-1B-shape model
// then dequantizes 2048 rows of 2048 values on one core: 3.2 ms for Q8_0 and
// 12.5 ms for the Q6_K embeddings that Q4_0 and Q4_K_M models carry, about a
// seventh of the whole step on an H200 (bench/results/dream_gpu_profile_h200_2026-12-02_tenth_*.txt).
// The rewrite below computes the same rows with the same row dequantizer
// (ggml's type traits, which ggml-cpu's GET_ROWS calls too), split over the
// backend's threads: the values are bit for bit ggml's.

#include "dream-stage.h"
#include "dream-testing.h"

#include "ggml-backend.h"

#include <cstring>

namespace {

// dst[:, i] = row ids[i] of src0, rows of the gather split over threads in blocks
void dream_get_rows_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * ids = dst->src[1];
    const int64_t n = ids->ne[0], nc = w->ne[0];
    const int64_t per = (n + nth - 1) / nth;
    const int64_t r0 = per * ith, r1 = std::min<int64_t>(n, r0 + per);
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;
    for (int64_t i = r0; i < r1; ++i) {
        const int32_t row = *(const int32_t *) ((const char *) ids->data + i * ids->nb[0]);
        GGML_ASSERT(row >= 0 && row < w->ne[1]);
        const char * src = (const char *) w->data + row * w->nb[1];
        float * out = (float *) ((char *) dst->data + i * dst->nb[1]);
        if (w->type == GGML_TYPE_F32) {
            std::memcpy(out, src, nc * sizeof(float));
        } else {
            to_float(src, out, nc);
        }
    }
}

} // namespace

bool dream_cpu_get_rows_rewrite(ggml_context * ctx, ggml_tensor * n) {
    if (n->op != GGML_OP_GET_ROWS) {
        return false;
    }
    ggml_tensor * w = n->src[0];
    ggml_tensor * ids = n->src[1];
    // a plain host matrix (no repacked layout: CPU_REPACK tensors carry an extra)
    // gathered by a vector of row ids, enough rows to be worth waking the threads
    if (!w->buffer || !ggml_backend_buffer_is_host(w->buffer) || w->extra != nullptr || w->ne[2] != 1 ||
        w->ne[3] != 1 || w->nb[0] != ggml_type_size(w->type) ||
        (w->type != GGML_TYPE_F32 && ggml_get_type_traits(w->type)->to_float == nullptr) ||
        ids->type != GGML_TYPE_I32 || ids->ne[1] != 1 || ids->ne[2] != 1 || ids->ne[3] != 1 ||
        ids->ne[0] < DREAM_GET_ROWS_MIN || n->type != GGML_TYPE_F32 || n->ne[0] != w->ne[0] ||
        n->ne[1] != ids->ne[0] || n->nb[0] != sizeof(float)) {
        return false;
    }
    ggml_tensor * args[2] = { w, ids };
    dream_take_op(n, ggml_custom_4d(ctx, GGML_TYPE_F32, n->ne[0], n->ne[1], 1, 1, args, 2, dream_get_rows_op,
                                    GGML_N_TASKS_MAX, nullptr));
    return true;
}

bool dream_cpu_get_rows_check(int32_t type, const void * w, int64_t n_embd, int64_t n_rows, const int32_t * ids,
                              int64_t n_ids, int32_t n_threads, bool rewrite, float * out, bool * rewritten) {
    const ggml_type t = (ggml_type) type;
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0 || n_embd <= 0 || n_embd % ggml_blck_size(t) != 0 ||
        n_rows <= 0 || n_ids <= 0 || n_threads <= 0 || (t != GGML_TYPE_F32 && !ggml_get_type_traits(t)->to_float)) {
        return false;
    }
    for (int64_t i = 0; i < n_ids; ++i) {
        if (ids[i] < 0 || ids[i] >= n_rows) {
            return false;
        }
    }
    ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    if (!ctx || !cpu) {
        ggml_free(ctx);
        return false;
    }
    ggml_backend_cpu_set_n_threads(cpu, n_threads);
    ggml_tensor * tw = ggml_new_tensor_2d(ctx, t, n_embd, n_rows);
    ggml_tensor * tid = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_ids);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, cpu);   // weights and ids first, as a model's are
    ggml_tensor * rows = ggml_get_rows(ctx, tw, tid);
    bool ok = buf != nullptr;
    ggml_backend_buffer_t obuf = nullptr;
    if (ok) {
        ggml_backend_tensor_set(tw, w, 0, ggml_nbytes(tw));
        ggml_backend_tensor_set(tid, ids, 0, ggml_nbytes(tid));
        *rewritten = rewrite && dream_cpu_get_rows_rewrite(ctx, rows);
        ggml_cgraph * g = ggml_new_graph(ctx);
        ggml_build_forward_expand(g, rows);
        obuf = ggml_backend_alloc_ctx_tensors(ctx, cpu);
        ok = obuf != nullptr && ggml_backend_graph_compute(cpu, g) == GGML_STATUS_SUCCESS;
        if (ok) {
            ggml_backend_tensor_get(rows, out, 0, ggml_nbytes(rows));
        }
    }
    ggml_backend_buffer_free(obuf);
    ggml_backend_buffer_free(buf);
    ggml_backend_free(cpu);
    ggml_free(ctx);
    return ok;
}
