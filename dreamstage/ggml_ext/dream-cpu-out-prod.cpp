// The CPU kernel for the F32 OUT_PRODs of a training graph (attention's
// backward and the LoRA factors' gradients; 15% of a default-model step at
// chunk 256 before it).
//
// OUT_PROD(a, b) is dst[i0, i1, i2, i3] = sum_k a[i0, k, i2/r2, i3/r3] b[i1, k, i2, i3]:
// a sum over k of outer products. ggml's CPU op runs it as one AXPY of a's row
// k into dst's row i1 per (i1, k), so every dst row is read and written again
// for each k. Here a register tile of 32 columns x up to 12 rows of dst stays
// in registers for the whole sum over k: per k, two loads of a's row and one
// broadcast of b per row feed 24 FMAs. With AVX2 only (16 registers) a tile is
// 16 columns x up to 6 rows. CPUs with neither, and operands whose rows are
// not contiguous along i0, keep ggml's op.
#include "dream-stage.h"
#include "dream-testing.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t OP_TT = 12;   // dst rows per register tile: 24 accumulators of 32 registers

struct op_args {
    const char * a;
    const char * b;
    char * d;
    int64_t ne0, ne1, nk;       // dst columns (a's i0), dst rows (b's i0), the summed k
    size_t a_k;                 // bytes between a's rows k
    size_t b_i, b_k;            // bytes between b's elements along i1 and along k
    size_t d_row;               // bytes between dst rows
};

// dst rows i1 .. i1+NT, columns i0 .. i0+32 (masked past ne0)
template <int NT>
__attribute__((target("avx512f"))) void op_tile(const op_args & g, int64_t i1, int64_t i0) {
    const int64_t left = g.ne0 - i0;
    const __mmask16 m0 = left >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? (__mmask16) 0xFFFF : left <= 16 ? (__mmask16) 0 : (__mmask16) ((1u << (left - 16)) - 1);
    __m512 acc[NT][2];
#pragma GCC unroll 12
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = _mm512_setzero_ps();
        acc[t][1] = _mm512_setzero_ps();
    }
    const char * ap = g.a + i0 * sizeof(float);
    const char * bp = g.b + i1 * g.b_i;
    for (int64_t k = 0; k < g.nk; ++k, ap += g.a_k, bp += g.b_k) {
        const __m512 w0 = _mm512_maskz_loadu_ps(m0, ap);
        const __m512 w1 = _mm512_maskz_loadu_ps(m1, ap + 64);
#pragma GCC unroll 12
        for (int t = 0; t < NT; ++t) {
            const __m512 v = _mm512_set1_ps(*(const float *) (bp + t * g.b_i));
            acc[t][0] = _mm512_fmadd_ps(w0, v, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, v, acc[t][1]);
        }
    }
#pragma GCC unroll 12
    for (int t = 0; t < NT; ++t) {
        float * out = (float *) (g.d + (i1 + t) * g.d_row) + i0;
        _mm512_mask_storeu_ps(out, m0, acc[t][0]);
        _mm512_mask_storeu_ps(out + 16, m1, acc[t][1]);
    }
}

void op_tiles(const op_args & g, int64_t i1, int64_t i0, int nt) {
    switch (nt) {
        case 1: op_tile<1>(g, i1, i0); break;
        case 2: op_tile<2>(g, i1, i0); break;
        case 3: op_tile<3>(g, i1, i0); break;
        case 4: op_tile<4>(g, i1, i0); break;
        case 5: op_tile<5>(g, i1, i0); break;
        case 6: op_tile<6>(g, i1, i0); break;
        case 7: op_tile<7>(g, i1, i0); break;
        case 8: op_tile<8>(g, i1, i0); break;
        case 9: op_tile<9>(g, i1, i0); break;
        case 10: op_tile<10>(g, i1, i0); break;
        case 11: op_tile<11>(g, i1, i0); break;
        default: op_tile<12>(g, i1, i0); break;
    }
}

// AVX2 (16 registers): dst rows i1 .. i1+NT, columns i0 .. i0+16 (masked past
// ne0), 2 NT accumulators; the same sums over k in the same order as op_tile.
constexpr int64_t OP_TT_AVX2 = 6, OP_TI_AVX2 = 16;

__attribute__((target("avx2,fma"))) inline __m256i lanes_below(int64_t n) {   // lane j set while j < n
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int) std::max<int64_t>(0, std::min<int64_t>(n, 8))), idx);
}

template <int NT>
__attribute__((target("avx2,fma"))) void op_tile_avx2(const op_args & g, int64_t i1, int64_t i0) {
    const int64_t left = g.ne0 - i0;
    const __m256i m0 = lanes_below(left), m1 = lanes_below(left - 8);
    __m256 acc[NT][2];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = _mm256_setzero_ps();
        acc[t][1] = _mm256_setzero_ps();
    }
    const char * ap = g.a + i0 * sizeof(float);
    const char * bp = g.b + i1 * g.b_i;
    for (int64_t k = 0; k < g.nk; ++k, ap += g.a_k, bp += g.b_k) {
        const __m256 w0 = _mm256_maskload_ps((const float *) ap, m0);
        const __m256 w1 = _mm256_maskload_ps((const float *) ap + 8, m1);
#pragma GCC unroll 6
        for (int t = 0; t < NT; ++t) {
            const __m256 v = _mm256_broadcast_ss((const float *) (bp + t * g.b_i));
            acc[t][0] = _mm256_fmadd_ps(w0, v, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, v, acc[t][1]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        float * out = (float *) (g.d + (i1 + t) * g.d_row) + i0;
        _mm256_maskstore_ps(out, m0, acc[t][0]);
        _mm256_maskstore_ps(out + 8, m1, acc[t][1]);
    }
}

void op_tiles_avx2(const op_args & g, int64_t i1, int64_t i0, int nt) {
    switch (nt) {
        case 1: op_tile_avx2<1>(g, i1, i0); break;
        case 2: op_tile_avx2<2>(g, i1, i0); break;
        case 3: op_tile_avx2<3>(g, i1, i0); break;
        case 4: op_tile_avx2<4>(g, i1, i0); break;
        case 5: op_tile_avx2<5>(g, i1, i0); break;
        default: op_tile_avx2<6>(g, i1, i0); break;
    }
}

// the register tile this CPU takes: rows, columns, and the function
struct op_tiling {
    int64_t rows, cols;
    void (*run)(const op_args &, int64_t, int64_t, int);
};

op_tiling tiling() {
    if (dream_cpu_avx512()) {
        return { OP_TT, 32, op_tiles };
    }
    return { OP_TT_AVX2, OP_TI_AVX2, op_tiles_avx2 };
}

// Thread ith of nth takes every nth tile of (i3, i2, row tile, column tile).
void dream_out_prod_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * a = dst->src[0];
    const ggml_tensor * b = dst->src[1];
    const int64_t r2 = dst->ne[2] / a->ne[2], r3 = dst->ne[3] / a->ne[3];
    const op_tiling tl = tiling();
    const int64_t row_tiles = (dst->ne[1] + tl.rows - 1) / tl.rows, col_tiles = (dst->ne[0] + tl.cols - 1) / tl.cols;
    const int64_t per_mat = row_tiles * col_tiles;
    const int64_t n_units = per_mat * dst->ne[2] * dst->ne[3];
    for (int64_t u = ith; u < n_units; u += nth) {
        const int64_t mat = u / per_mat, tile = u % per_mat;
        const int64_t i2 = mat % dst->ne[2], i3 = mat / dst->ne[2];
        const op_args g = { (const char *) a->data + (i2 / r2) * a->nb[2] + (i3 / r3) * a->nb[3],
                            (const char *) b->data + i2 * b->nb[2] + i3 * b->nb[3],
                            (char *) dst->data + i2 * dst->nb[2] + i3 * dst->nb[3],
                            dst->ne[0], dst->ne[1], a->ne[1], a->nb[1], b->nb[0], b->nb[1], dst->nb[1] };
        const int64_t i1 = (tile / col_tiles) * tl.rows, i0 = (tile % col_tiles) * tl.cols;
        tl.run(g, i1, i0, (int) std::min<int64_t>(tl.rows, dst->ne[1] - i1));
    }
}

} // namespace

bool dream_cpu_out_prod_supported(const ggml_tensor * n) {
    const ggml_tensor * a = n->src[0];
    const ggml_tensor * b = n->src[1];
    return (dream_cpu_avx512() || dream_cpu_avx2()) && n->op == GGML_OP_OUT_PROD && n->type == GGML_TYPE_F32 && a->type == GGML_TYPE_F32 &&
           b->type == GGML_TYPE_F32 && a->nb[0] == sizeof(float) && ggml_is_contiguous(n) && a->ne[1] == b->ne[1] &&
           n->ne[2] % a->ne[2] == 0 && n->ne[3] % a->ne[3] == 0 && n->ne[0] == a->ne[0] && n->ne[1] == b->ne[0] &&
           n->ne[2] == b->ne[2] && n->ne[3] == b->ne[3];
}

void dream_take_op(ggml_tensor * n, const ggml_tensor * k) {
    n->op = k->op;
    std::memcpy(n->op_params, k->op_params, sizeof(n->op_params));
    for (int j = 0; j < GGML_MAX_SRC; ++j) {
        n->src[j] = k->src[j];
    }
}

// n becomes the kernel's op on its own sources, in place (same shape, same users)
void dream_cpu_out_prod_rewrite(ggml_context * ctx, ggml_tensor * n) {
    ggml_tensor * args[2] = { n->src[0], n->src[1] };
    dream_take_op(n, ggml_custom_4d(ctx, GGML_TYPE_F32, n->ne[0], n->ne[1], n->ne[2], n->ne[3], args, 2,
                                    dream_out_prod_op, GGML_N_TASKS_MAX, nullptr));
}

bool dream_cpu_avx512() {
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes;
}

bool dream_cpu_avx2() {
    static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return yes;
}

bool dream_out_prod_f32(const float * a, int64_t ne0, int64_t nk, int64_t a_k, const float * b, int64_t ne1,
                        int64_t b_i, int64_t b_k, float * dst) {
    if (!(dream_cpu_avx512() || dream_cpu_avx2()) || !a || !b || !dst || ne0 <= 0 || ne1 <= 0 || nk <= 0 || a_k < ne0 ||
        b_i <= 0 || b_k <= 0) {
        return false;
    }
    const op_tiling tl = tiling();
    const op_args g = { (const char *) a, (const char *) b, (char *) dst, ne0, ne1, nk,
                        (size_t) a_k * sizeof(float), (size_t) b_i * sizeof(float), (size_t) b_k * sizeof(float),
                        (size_t) ne0 * sizeof(float) };
    for (int64_t i1 = 0; i1 < ne1; i1 += tl.rows) {
        for (int64_t i0 = 0; i0 < ne0; i0 += tl.cols) {
            tl.run(g, i1, i0, (int) std::min<int64_t>(tl.rows, ne1 - i1));
        }
    }
    return true;
}
