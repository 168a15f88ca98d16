// The CPU kernel for the backward through a frozen quantized weight.
//
// For y = W x (W stored as ggml does: n_out rows of n_in values), the input
// gradient is dx = W^T dy: dx[i, t] = sum_o W[i, o] dy[o, t]. ggml's backward
// writes it as OUT_PROD(W, dy^T), and the CPU OUT_PROD is an AXPY per (token,
// output row) that streams the whole of W from memory once per token and
// dequantizes a row per use (measured: 43% of a default-model micro-step).
//
// This kernel computes the same product as a blocked GEMM with no F32 copy of
// the model: each thread takes a slab of IB input columns, dequantizes that
// slab of a few hundred rows of W at a time into a small panel (it stays in
// L2), and multiplies the panel into a register tile of 32 columns x 4 tokens,
// so each weight value is dequantized once per step and read from cache once
// per 4 tokens. The sums run over o in order, in float32, as OUT_PROD's do.
#include "dream-stage.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float * p) {
    v16 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

inline void store16(float * p, v16 v) {
    std::memcpy(p, &v, sizeof(v));
}

constexpr int64_t TILE_I = 32;   // input columns per register tile (two 16-float vectors)
constexpr int64_t TILE_T = 4;    // tokens per register tile

struct product_shape {
    int64_t n_in, n_out, n_tok;
    int64_t ib;         // input columns per slab (a multiple of the type's block)
    int64_t oc;         // rows of W per panel
    size_t  row_bytes;  // bytes of one row of W
};

// dx[i0 .. i0+ni, t] (+)= sum over the panel's rows o0 .. o0+no of P[o][i] dy[o, t].
// P holds the slab dequantized: row r at P + r*ni. accumulate: add to dx
// (later panels), else overwrite it (the first panel of the slab).
__attribute__((target_clones("avx512f", "avx2,fma", "default")))
void panel_product(const float * P, int64_t ni, int64_t no, int64_t o0, const float * dy, float * dx,
                   const product_shape & s, int64_t i0, bool accumulate) {
    const int64_t n_out = s.n_out;
    for (int64_t t0 = 0; t0 < s.n_tok; t0 += TILE_T) {
        const int64_t nt = std::min(TILE_T, s.n_tok - t0);
        int64_t i = 0;
        for (; i + TILE_I <= ni; i += TILE_I) {
            v16 acc[TILE_T][2] = {};
            if (nt == TILE_T) {
                const float * d0 = dy + (t0 + 0) * n_out + o0;
                const float * d1 = dy + (t0 + 1) * n_out + o0;
                const float * d2 = dy + (t0 + 2) * n_out + o0;
                const float * d3 = dy + (t0 + 3) * n_out + o0;
                for (int64_t o = 0; o < no; ++o) {
                    const v16 w0 = load16(P + o * ni + i);
                    const v16 w1 = load16(P + o * ni + i + 16);
                    acc[0][0] += w0 * d0[o]; acc[0][1] += w1 * d0[o];
                    acc[1][0] += w0 * d1[o]; acc[1][1] += w1 * d1[o];
                    acc[2][0] += w0 * d2[o]; acc[2][1] += w1 * d2[o];
                    acc[3][0] += w0 * d3[o]; acc[3][1] += w1 * d3[o];
                }
            } else {
                for (int64_t o = 0; o < no; ++o) {
                    const v16 w0 = load16(P + o * ni + i);
                    const v16 w1 = load16(P + o * ni + i + 16);
                    for (int64_t t = 0; t < nt; ++t) {
                        const float d = dy[(t0 + t) * n_out + o0 + o];
                        acc[t][0] += w0 * d;
                        acc[t][1] += w1 * d;
                    }
                }
            }
            for (int64_t t = 0; t < nt; ++t) {
                float * out = dx + (t0 + t) * s.n_in + i0 + i;
                if (accumulate) {
                    store16(out, load16(out) + acc[t][0]);
                    store16(out + 16, load16(out + 16) + acc[t][1]);
                } else {
                    store16(out, acc[t][0]);
                    store16(out + 16, acc[t][1]);
                }
            }
        }
        // columns past the last full tile (n_in not a multiple of 32)
        for (; i < ni; ++i) {
            for (int64_t t = 0; t < nt; ++t) {
                float sum = 0.0f;
                for (int64_t o = 0; o < no; ++o) {
                    sum += P[o * ni + i] * dy[(t0 + t) * n_out + o0 + o];
                }
                float * out = dx + (t0 + t) * s.n_in + i0 + i;
                *out = accumulate ? *out + sum : sum;
            }
        }
    }
}

product_shape shape_of(ggml_type type, int64_t n_in, int64_t n_out, int64_t n_tok, size_t row_bytes) {
    product_shape s{ n_in, n_out, n_tok, 0, 0, row_bytes };
    const int64_t blck = ggml_blck_size(type);
    // a slab is at least 64 columns and whole blocks (256 for K-quants)
    s.ib = std::min(n_in, ((std::max<int64_t>(64, blck) + blck - 1) / blck) * blck);
    // a panel of about 64 KiB: it stays in L2 while every token tile reads it
    s.oc = std::max<int64_t>(16, (64 * 1024) / (int64_t) (s.ib * sizeof(float)));
    return s;
}

// Thread ith of nth: slabs ith, ith + nth, ...
void product_slabs(ggml_type type, const uint8_t * w, const float * dy, float * dx, const product_shape & s,
                   int ith, int nth) {
    const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
    const int64_t blck = ggml_blck_size(type);
    const size_t blck_bytes = ggml_type_size(type);
    thread_local std::vector<float> panel;
    panel.resize((size_t) (s.ib * s.oc));
    const int64_t n_slabs = (s.n_in + s.ib - 1) / s.ib;
    for (int64_t slab = ith; slab < n_slabs; slab += nth) {
        const int64_t i0 = slab * s.ib;
        const int64_t ni = std::min(s.ib, s.n_in - i0);
        const size_t col_bytes = (size_t) (i0 / blck) * blck_bytes;
        for (int64_t o0 = 0; o0 < s.n_out; o0 += s.oc) {
            const int64_t no = std::min(s.oc, s.n_out - o0);
            for (int64_t o = 0; o < no; ++o) {
                to_float(w + (size_t) (o0 + o) * s.row_bytes + col_bytes, panel.data() + o * ni, ni);
            }
            panel_product(panel.data(), ni, no, o0, dy, dx, s, i0, o0 > 0);
        }
    }
}

// ggml custom op: dst [n_in, n_tok] = W^T dy, src[0] = W (quantized, 2-D), src[1] = dy (F32 [n_out, n_tok], contiguous).
void dream_wt_dy_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * dy = dst->src[1];
    const product_shape s = shape_of(w->type, w->ne[0], w->ne[1], dy->ne[1], w->nb[1]);
    product_slabs(w->type, (const uint8_t *) w->data, (const float *) dy->data, (float *) dst->data, s, ith, nth);
}

} // namespace

bool dream_cpu_wt_dy_supported(const ggml_tensor * w, const ggml_tensor * dy) {
    if (!ggml_is_quantized(w->type) || !ggml_get_type_traits(w->type)->to_float) {
        return false;
    }
    // whole rows, no batch dims; a slab must start on a block boundary
    return ggml_n_dims(w) <= 2 && ggml_n_dims(dy) <= 2 && w->nb[0] == ggml_type_size(w->type) &&
           dy->ne[0] == w->ne[1] && w->ne[0] % ggml_blck_size(w->type) == 0;
}

ggml_tensor * dream_cpu_wt_dy(ggml_context * ctx, ggml_tensor * w, ggml_tensor * dy) {
    if (!ggml_is_contiguous(dy)) {
        dy = ggml_cont(ctx, dy);
    }
    ggml_tensor * args[2] = { w, dy };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[0], dy->ne[1], 1, 1, args, 2, dream_wt_dy_op, GGML_N_TASKS_MAX, nullptr);
}

bool dream_backward_product(int32_t type, const void * w, int64_t n_in, int64_t n_out, const float * dy,
                                       int64_t n_tok, float * dx) {
    const ggml_type t = (ggml_type) type;
    if (type < 0 || type >= GGML_TYPE_COUNT || !ggml_is_quantized(t) || !ggml_get_type_traits(t)->to_float ||
        n_in % ggml_blck_size(t) != 0 || n_in <= 0 || n_out <= 0 || n_tok <= 0) {
        return false;
    }
    const product_shape s = shape_of(t, n_in, n_out, n_tok, ggml_row_size(t, n_in));
    product_slabs(t, (const uint8_t *) w, dy, dx, s, 0, 1);
    return true;
}
