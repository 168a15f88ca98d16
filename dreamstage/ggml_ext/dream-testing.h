// Test hooks of the native core: its kernels on plain buffers, for the tests
// (tests/test_cpu_backward.py through ctypes) to compare against independent
// implementations. Compiled into libllama but no part of the production API
// (dream.h); dreamstage/native/dream_h.py declares them in its testing section.
#pragma once

#include "dream.h"

#ifdef __cplusplus
extern "C" {
#endif

// The CPU kernel of the backward through a frozen quantized weight, on plain
// buffers (for tests against an independent implementation): dx[n_tok][n_in]
// = W^T dy, W = n_out rows of n_in values of ggml type `type` (as stored in a
// GGUF), dy[n_tok][n_out] F32. One thread. Returns false (dx untouched) for a
// type without a dequantizer or n_in not a multiple of its block size.
LLAMA_API bool dream_backward_product(int32_t type, const void * w, int64_t n_in, int64_t n_out, const float * dy,
                                      int64_t n_tok, float * dx);

// The CPU kernel for a training graph's F32 OUT_PRODs, on plain buffers (for
// tests): dst[i1][i0] = sum_k a[k * a_k + i0] b[i1 * b_i + k * b_k] (strides in
// floats), dst ne1 rows of ne0. One thread. Returns false (dst untouched) on a
// CPU without AVX2 and FMA (the graph then keeps ggml's OUT_PROD) or bad sizes.
LLAMA_API bool dream_out_prod_f32(const float * a, int64_t ne0, int64_t nk, int64_t a_k, const float * b, int64_t ne1,
                                  int64_t b_i, int64_t b_k, float * dst);

// The vectorized e^x of the CPU cross-entropy and SILU_BACK kernels, on a
// plain buffer (for tests against libm). False on a CPU without AVX-512.
LLAMA_API bool dream_cpu_exp_check(const float * x, int64_t n, float * out);

// A training graph's row gather of host-resident embeddings (dream-cpu-rows.cpp),
// on plain buffers (for tests): out[i] = row ids[i] of W (n_rows rows of n_embd
// values of ggml type `type`, as stored in a GGUF), dequantized to F32, as a
// one-node ggml graph on a CPU backend of n_threads. rewrite: the node becomes the
// threaded gather where it qualifies (*rewritten says whether it did); else ggml's
// GET_ROWS. Returns false (out untouched) for bad sizes, a type without a
// dequantizer or an id out of range.
LLAMA_API bool dream_cpu_get_rows_check(int32_t type, const void * w, int64_t n_embd, int64_t n_rows, const int32_t * ids,
                                        int64_t n_ids, int32_t n_threads, bool rewrite, float * out, bool * rewritten);

// SwiGLU's one-node backward (dream-glu.cpp), on a CPU backend of n_threads (for
// tests): the gradients of g and u (n_ff x n_tok floats each, row-major by token)
// of loss = sum(w * silu(g) * u), from a backward built with the fused node
// (fused) or with ggml's own, into dg and du; *fused_nodes counts the fused
// nodes in that graph. The choice holds for that graph only, on the calling thread.
// False for bad sizes (at most 2^26
// elements) or a failed compute.
LLAMA_API bool dream_swiglu_back_check(const float * g, const float * u, const float * w, int64_t n_ff, int64_t n_tok,
                                       int32_t n_threads, bool fused, float * dg, float * du, int32_t * fused_nodes);

#ifdef __cplusplus
}
#endif
