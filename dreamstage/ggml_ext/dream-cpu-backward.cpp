// The CPU kernels for products with a frozen quantized weight in training graphs:
// the backward dx = W^T dy, and the forward y = W x.
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
// L2), and multiplies the panel into a register tile of 32 columns x 8 tokens
// (4 without AVX-512),
// so each weight value is dequantized once per step and read from cache once
// per tile of tokens. The sums run over o in order, in float32, as OUT_PROD's do.
//
// The forward y = W x uses the same panels and tile, transposed: a slab of 32
// rows of W is dequantized and laid out input-major, and x is first rounded
// to the weight's activation type exactly as ggml's quantized MUL_MAT rounds it
// (ggml-cpu's own quantizer, then back to float), so the training forward
// computes what serving computes, up to float summation order. ggml's kernel
// multiplies block by block with integer dot products; this one reads each
// dequantized weight from cache once per tile of tokens.
#include "dream-stage.h"

#include "ggml-cpu.h"
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

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

struct product_shape {
    int64_t n_in, n_out, n_tok;
    int64_t ib;         // input columns per slab (a multiple of the type's block)
    int64_t oc;         // rows of W per panel
    size_t  row_bytes;  // bytes of one row of W
};

// dx[i0 .. i0+ni, t] (+)= sum over the panel's rows o0 .. o0+no of P[o][i] dy[o, t].
// P holds the slab dequantized: row r at P + r*ni. accumulate: add to dx
// (later panels), else overwrite it (the first panel of the slab).
// In general terms: out[t][c0 + c] (+)= sum_r P[r][c] in[t][r0 + r], with
// in's rows in_stride apart and out's out_stride apart (per token).
// TT tokens per register tile: 2 x TT accumulators of 16 floats.
template <int TT>
inline __attribute__((always_inline)) void panel_product_t(const float * P, int64_t ni, int64_t no, int64_t o0,
                                                           const float * dy, float * dx, int64_t n_tok, int64_t in_stride,
                                                           int64_t out_stride, int64_t i0, bool accumulate) {
    const int64_t n_out = in_stride;
    for (int64_t t0 = 0; t0 < n_tok; t0 += TT) {
        const int64_t nt = std::min<int64_t>(TT, n_tok - t0);
        int64_t i = 0;
        for (; i + TILE_I <= ni; i += TILE_I) {
            v16 acc[TT][2] = {};
            if (nt == TT) {
                const float * d = dy + t0 * n_out + o0;
                for (int64_t o = 0; o < no; ++o) {
                    const v16 w0 = load16(P + o * ni + i);
                    const v16 w1 = load16(P + o * ni + i + 16);
#pragma GCC unroll 8
                    for (int t = 0; t < TT; ++t) {
                        const float b = d[t * n_out + o];
                        acc[t][0] += w0 * b;
                        acc[t][1] += w1 * b;
                    }
                }
            } else {
                for (int64_t o = 0; o < no; ++o) {
                    const v16 w0 = load16(P + o * ni + i);
                    const v16 w1 = load16(P + o * ni + i + 16);
                    for (int64_t t = 0; t < nt; ++t) {
                        const float b = dy[(t0 + t) * n_out + o0 + o];
                        acc[t][0] += w0 * b;
                        acc[t][1] += w1 * b;
                    }
                }
            }
            for (int64_t t = 0; t < nt; ++t) {
                float * out = dx + (t0 + t) * out_stride + i0 + i;
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
                float * out = dx + (t0 + t) * out_stride + i0 + i;
                *out = accumulate ? *out + sum : sum;
            }
        }
    }
}

using panel_fn = void (*)(const float *, int64_t, int64_t, int64_t, const float *, float *, int64_t, int64_t, int64_t,
                          int64_t, bool);

// One build for every x86-64 CPU: AVX-512 has 32 vector registers, room for
// an 8-token tile (16 accumulators); AVX2 has 16, so 4 tokens.
__attribute__((target("avx512f"))) void panel_product_avx512(const float * P, int64_t ni, int64_t no, int64_t o0,
        const float * dy, float * dx, int64_t n_tok, int64_t in_stride, int64_t out_stride, int64_t i0, bool acc) {
    panel_product_t<8>(P, ni, no, o0, dy, dx, n_tok, in_stride, out_stride, i0, acc);
}

__attribute__((target("avx2,fma"))) void panel_product_avx2(const float * P, int64_t ni, int64_t no, int64_t o0,
        const float * dy, float * dx, int64_t n_tok, int64_t in_stride, int64_t out_stride, int64_t i0, bool acc) {
    panel_product_t<4>(P, ni, no, o0, dy, dx, n_tok, in_stride, out_stride, i0, acc);
}

void panel_product_base(const float * P, int64_t ni, int64_t no, int64_t o0, const float * dy, float * dx,
                        int64_t n_tok, int64_t in_stride, int64_t out_stride, int64_t i0, bool acc) {
    panel_product_t<4>(P, ni, no, o0, dy, dx, n_tok, in_stride, out_stride, i0, acc);
}

void panel_product(const float * P, int64_t ni, int64_t no, int64_t o0, const float * dy, float * dx, int64_t n_tok,
                   int64_t in_stride, int64_t out_stride, int64_t i0, bool accumulate) {
    static const panel_fn fn = __builtin_cpu_supports("avx512f")                                  ? panel_product_avx512
                               : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? panel_product_avx2
                                                                                                 : panel_product_base;
    fn(P, ni, no, o0, dy, dx, n_tok, in_stride, out_stride, i0, accumulate);
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
            panel_product(panel.data(), ni, no, o0, dy, dx, s.n_tok, s.n_out, s.n_in, i0, o0 > 0);
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

// Activations rounded as ggml's quantized MUL_MAT rounds them: quantized to
// the weight's vec_dot_type by ggml-cpu's own quantizer, then read back.
// Returns false for a type this does not know how to read back.
bool round_activations(ggml_type vdt, const float * x, float * out, int64_t n, std::vector<uint8_t> & buf) {
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(vdt)->from_float;
    if (!quantize) {
        return false;
    }
    buf.resize(ggml_row_size(vdt, n));
    quantize(x, buf.data(), n);
    switch (vdt) {
        case GGML_TYPE_Q8_0:
            ggml_get_type_traits(vdt)->to_float(buf.data(), out, n);
            return true;
        case GGML_TYPE_Q8_1: {
            // the block starts with its scale d and s = d * sum(q), both fp16;
            // s goes after the row (out[n + k]): ggml multiplies it by the
            // weight block's min instead of summing the values themselves
            const auto * b = (const block_q8_1 *) buf.data();
            for (int64_t k = 0; k < n / QK8_1; ++k) {
                ggml_fp16_t ds[2];
                std::memcpy(ds, &b[k], sizeof(ds));
                const float d = ggml_fp16_to_fp32(ds[0]);
                for (int j = 0; j < QK8_1; ++j) {
                    out[k * QK8_1 + j] = d * b[k].qs[j];
                }
                out[n + k] = ggml_fp16_to_fp32(ds[1]);
            }
            return true;
        }
        case GGML_TYPE_Q8_K: {
            const auto * b = (const block_q8_K *) buf.data();
            for (int64_t k = 0; k < n / QK_K; ++k) {
                for (int j = 0; j < QK_K; ++j) {
                    out[k * QK_K + j] = b[k].d * b[k].qs[j];
                }
            }
            return true;
        }
        default:
            return false;
    }
}

ggml_type activation_type(ggml_type wtype) {
    return ggml_get_type_traits_cpu(wtype)->vec_dot_type;
}

// Weights with a per-block min (Q4_1, Q5_1) meet Q8_1 activations: ggml
// computes a block as d_w d_x sum(q_w q_x) + m_w s_x, with s_x the fp16 block
// sum. The kernel follows it: the panel holds d_w q_w, and the mins multiply
// the block sums separately.
bool weight_has_mins(ggml_type wtype) {
    return wtype == GGML_TYPE_Q4_1 || wtype == GGML_TYPE_Q5_1;
}

bool activation_type_known(ggml_type wtype) {
    const ggml_type vdt = activation_type(wtype);
    return vdt == GGML_TYPE_Q8_0 || vdt == GGML_TYPE_Q8_K || (vdt == GGML_TYPE_Q8_1 && weight_has_mins(wtype));
}

// floats per token of the rounded activations: the row, then (Q8_1) its block sums
int64_t rounded_row(ggml_type wtype, int64_t n_in) {
    return n_in + (activation_type(wtype) == GGML_TYPE_Q8_1 ? n_in / QK8_1 : 0);
}

// x [n_tok][n_in] -> rounded rows [n_tok][rounded_row], token t on thread t % nth
void round_rows(ggml_type wtype, const float * x, float * out, int64_t n_in, int64_t n_tok, int ith, int nth) {
    thread_local std::vector<uint8_t> buf;
    const int64_t stride = rounded_row(wtype, n_in);
    for (int64_t t = ith; t < n_tok; t += nth) {
        round_activations(activation_type(wtype), x + t * n_in, out + t * stride, n_in, buf);
    }
}

// y [n_tok][n_out] = W x: slabs of TILE_I rows of W, slab ith, ith + nth, ...
// x holds the rounded activations, rounded_row floats per token.
void forward_slabs(ggml_type type, const uint8_t * w, size_t row_bytes, const float * x, float * y, int64_t n_in,
                   int64_t n_out, int64_t n_tok, int ith, int nth) {
    const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
    const bool mins = weight_has_mins(type);
    const int64_t n_blk = n_in / QK8_1;
    const int64_t x_stride = rounded_row(type, n_in);
    const size_t blk_bytes = ggml_type_size(type);
    thread_local std::vector<float> rows, panel, m;
    rows.resize((size_t) (TILE_I * n_in));
    panel.resize((size_t) (TILE_I * n_in));
    m.resize((size_t) (TILE_I * n_blk));
    const int64_t n_slabs = (n_out + TILE_I - 1) / TILE_I;
    for (int64_t slab = ith; slab < n_slabs; slab += nth) {
        const int64_t o0 = slab * TILE_I;
        const int64_t no = std::min(TILE_I, n_out - o0);
        for (int64_t o = 0; o < no; ++o) {
            const uint8_t * row = w + (size_t) (o0 + o) * row_bytes;
            float * r = rows.data() + o * n_in;
            to_float(row, r, n_in);
            if (mins) {
                // the block's second fp16 field is its min; the panel keeps d q only
                for (int64_t k = 0; k < n_blk; ++k) {
                    ggml_fp16_t dm[2];
                    std::memcpy(dm, row + k * blk_bytes, sizeof(dm));
                    const float mk = ggml_fp16_to_fp32(dm[1]);
                    m[o * n_blk + k] = mk;
                    for (int j = 0; j < QK8_1; ++j) {
                        r[k * QK8_1 + j] -= mk;
                    }
                }
            }
        }
        // input-major: panel[i][o]
        for (int64_t i = 0; i < n_in; ++i) {
            for (int64_t o = 0; o < no; ++o) {
                panel[i * no + o] = rows[o * n_in + i];
            }
        }
        panel_product(panel.data(), no, n_in, 0, x, y, n_tok, x_stride, n_out, o0, false);
        if (mins) {
            for (int64_t t = 0; t < n_tok; ++t) {
                const float * sums = x + t * x_stride + n_in;
                for (int64_t o = 0; o < no; ++o) {
                    float acc = 0.0f;
                    for (int64_t k = 0; k < n_blk; ++k) {
                        acc += m[o * n_blk + k] * sums[k];
                    }
                    y[t * n_out + o0 + o] += acc;
                }
            }
        }
    }
}

void dream_round_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * x = dst->src[0];
    round_rows(dst->src[1]->type, (const float *) x->data, (float *) dst->data, x->ne[0], x->ne[1], ith, nth);
}

void dream_wx_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * x = dst->src[1];
    forward_slabs(w->type, (const uint8_t *) w->data, w->nb[1], (const float *) x->data, (float *) dst->data,
                  w->ne[0], w->ne[1], dst->ne[1], ith, nth);
}

} // namespace

bool dream_cpu_wx_supported(const ggml_tensor * w, const ggml_tensor * x) {
    if (!ggml_is_quantized(w->type) || !ggml_get_type_traits(w->type)->to_float) {
        return false;
    }
    const ggml_type vdt = activation_type(w->type);
    return activation_type_known(w->type) && x->type == GGML_TYPE_F32 && ggml_is_contiguous(x) &&
           ggml_n_dims(w) <= 2 && ggml_n_dims(x) <= 2 && w->nb[0] == ggml_type_size(w->type) &&
           x->ne[0] == w->ne[0] && w->ne[0] % ggml_blck_size(vdt) == 0 && w->ne[0] % ggml_blck_size(w->type) == 0;
}

ggml_tensor * dream_cpu_wx(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x) {
    // the rounded activations carry the weight as a second source only to know its type
    ggml_tensor * rargs[2] = { x, w };
    ggml_tensor * xr = ggml_custom_4d(ctx, GGML_TYPE_F32, rounded_row(w->type, x->ne[0]), x->ne[1], 1, 1, rargs, 2, dream_round_op,
                                      GGML_N_TASKS_MAX, nullptr);
    ggml_tensor * args[2] = { w, xr };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, dream_wx_op, GGML_N_TASKS_MAX, nullptr);
}

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

bool dream_forward_product(int32_t type, const void * w, int64_t n_in, int64_t n_out, const float * x, int64_t n_tok,
                           float * y, bool reference) {
    const ggml_type t = (ggml_type) type;
    if (type < 0 || type >= GGML_TYPE_COUNT || !ggml_is_quantized(t) || !ggml_get_type_traits(t)->to_float ||
        n_in <= 0 || n_out <= 0 || n_tok <= 0 || n_in % ggml_blck_size(t) != 0 ||
        !activation_type_known(t) || n_in % ggml_blck_size(activation_type(t)) != 0) {
        return false;
    }
    if (!reference) {
        std::vector<float> xr((size_t) (rounded_row(t, n_in) * n_tok));
        round_rows(t, x, xr.data(), n_in, n_tok, 0, 1);
        forward_slabs(t, (const uint8_t *) w, ggml_row_size(t, n_in), xr.data(), y, n_in, n_out, n_tok, 0, 1);
        return true;
    }
    // ggml's own quantized MUL_MAT on the CPU backend, one thread
    // tensors, graph, and the work buffer ggml_graph_compute_with_ctx takes from
    // the same context (the activations converted to the weight's dot type)
    ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead() + ggml_row_size(t, n_in) * n_out +
                            sizeof(float) * (size_t) (3 * n_in + n_out) * n_tok + (1 << 20), nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * tw = ggml_new_tensor_2d(ctx, t, n_in, n_out);
    ggml_tensor * tx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, n_tok);
    std::memcpy(tw->data, w, ggml_nbytes(tw));
    std::memcpy(tx->data, x, ggml_nbytes(tx));
    ggml_tensor * ty = ggml_mul_mat(ctx, tw, tx);
    ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, ty);
    const ggml_status st = ggml_graph_compute_with_ctx(ctx, g, 1);
    if (st == GGML_STATUS_SUCCESS) {
        std::memcpy(y, ty->data, ggml_nbytes(ty));
    }
    ggml_free(ctx);
    return st == GGML_STATUS_SUCCESS;
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
