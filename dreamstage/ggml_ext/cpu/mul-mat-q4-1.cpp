// A batched CPU kernel for MUL_MAT through a Q4_1 weight, compiled into
// ggml-cpu and reached through the hook in vendor/patches/0102-*.
//
// ggml multiplies a Q4_1 weight by a batch one (row, column) dot product at a
// time (its Q4_1 x Q8_1 vec_dot): every product unpacks the row's nibbles and
// converts both blocks' fp16 scales again, so a 32-token chunk repeats that
// work 32 times. Here a register tile of 2 weight rows x 4 columns unpacks each
// weight block once per tile and each activation block once per row pair.
//
// The result is bit for bit ggml's: for every (row, column) the same float
// operations run in the same order (one FMA of d_x*d_y times the block's
// integer dot per block into 8 lanes, the mins' term summed with scalar FMAs,
// the lanes reduced in the same pairwise order, then the mins' sum added).
// Integer dot products are exact, so how the 8 lane sums are formed does not
// matter; which block elements land in which lane does, and is the same.
// So serving's prefill, decode (one column: ggml's own vec_dot) and the dream
// stage's training forward compute one function, whatever the chunk size.
// On first use the kernel checks that on a sample against ggml's vec_dot of
// this very build and turns itself off if they differ (another compiler's
// contraction choices, say). DREAMSTAGE_CPU_MUL_MAT=ggml turns it off too.
#include "../dream-switches.h"
#include "ggml.h"
#include "ggml-cpu.h"
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DREAM_Q4_1_TILES 1
#endif

#ifdef DREAM_Q4_1_TILES
namespace {

inline float half_to_float(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

// the 8 lanes of one block's integer dot product, converted to float; lane k
// sums elements 4k..4k+3 (the low nibbles are elements 0..15, the high ones 16..31)
inline __m256 block_dot(__m256i qx, __m256i qy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), qx, qy));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), _mm256_set1_epi16(1)));
#endif
}

// upper half plus lower half, then the two pairs, then the last pair: the
// order of ggml's x86 vec_dot reduction, which fixes the rounding
inline float lane_total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The activation blocks' fp16 scales of up to 4 columns, as floats, block by
// block: d[ib][c] and s[ib][c] (column c's d and d * sum(q) of block ib).
struct col_scales {
    std::vector<float> d, s;
    void fill(const uint8_t * y, size_t y_stride, int C, int64_t nb) {
        d.assign((size_t) nb * 4, 0.0f);
        s.assign((size_t) nb * 4, 0.0f);
        for (int c = 0; c < C; ++c) {
            const uint8_t * b = y + c * y_stride;
            for (int64_t ib = 0; ib < nb; ++ib, b += sizeof(block_q8_1)) {
                d[ib * 4 + c] = half_to_float(b);
                s[ib * 4 + c] = half_to_float(b + 2);
            }
        }
    }
};

// out[c * out_stride + r] = row r of x (Q4_1) . column c of y (Q8_1), R rows x C columns, nb blocks.
// The mins' sums of the C columns share one 4-lane register per row (each lane
// its own column's scalar FMA chain, in block order as ggml's scalar).
template <int R, int C>
void tile(const uint8_t * x, size_t x_stride, const uint8_t * y, size_t y_stride, const col_scales & cs, int64_t nb,
          float * out, int64_t out_stride) {
    __m256 acc[R][C];
    __m128 mins[R];
    for (int r = 0; r < R; ++r) {
        mins[r] = _mm_setzero_ps();
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
        }
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t ib = 0; ib < nb; ++ib) {
        const float * dy = &cs.d[ib * 4];
        const __m128 sy = _mm_loadu_ps(&cs.s[ib * 4]);
        __m256i qx[R];
        float dx[R];
        for (int r = 0; r < R; ++r) {
            const uint8_t * b = x + r * x_stride + ib * sizeof(block_q4_1);
            dx[r] = half_to_float(b);
            mins[r] = _mm_fmadd_ps(_mm_set1_ps(half_to_float(b + 2)), sy, mins[r]);
            const __m128i q = _mm_loadu_si128((const __m128i *) (b + 4));
            qx[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
        }
        for (int c = 0; c < C; ++c) {
            const __m256i qy = _mm256_loadu_si256((const __m256i *) (y + c * y_stride + ib * sizeof(block_q8_1) + 4));
            for (int r = 0; r < R; ++r) {
                acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dx[r] * dy[c]), block_dot(qx[r], qy), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        alignas(16) float m[4];
        _mm_store_ps(m, mins[r]);
        for (int c = 0; c < C; ++c) {
            out[c * out_stride + r] = lane_total(acc[r][c]) + m[c];
        }
    }
}

template <int R>
void tile_cols(int C, const uint8_t * x, size_t xs, const uint8_t * y, size_t ys, const col_scales & cs, int64_t nb,
               float * out, int64_t os) {
    switch (C) {
        case 1: tile<R, 1>(x, xs, y, ys, cs, nb, out, os); break;
        case 2: tile<R, 2>(x, xs, y, ys, cs, nb, out, os); break;
        case 3: tile<R, 3>(x, xs, y, ys, cs, nb, out, os); break;
        default: tile<R, 4>(x, xs, y, ys, cs, nb, out, os); break;
    }
}

constexpr int TILE_R = 4;

// rows r0..r1 of x times columns c0..c1 of y into out (column c at out + c * out_stride)
void product(const uint8_t * x, size_t x_stride, const uint8_t * y, size_t y_stride, int64_t n_in, int64_t r0,
             int64_t r1, int64_t c0, int64_t c1, float * out, int64_t out_stride) {
    const int64_t nb = n_in / QK4_1;
    thread_local col_scales cs;
    for (int64_t c = c0; c < c1; c += 4) {
        const int C = (int) std::min<int64_t>(4, c1 - c);
        const uint8_t * yc = y + c * y_stride;
        cs.fill(yc, y_stride, C, nb);
        for (int64_t r = r0; r < r1;) {
            const uint8_t * xr = x + r * x_stride;
            float * o = out + c * out_stride + r;
            if (r + TILE_R <= r1) {
                tile_cols<TILE_R>(C, xr, x_stride, yc, y_stride, cs, nb, o, out_stride);
                r += TILE_R;
            } else {
                tile_cols<1>(C, xr, x_stride, yc, y_stride, cs, nb, o, out_stride);
                r += 1;
            }
        }
    }
}

// Does the kernel give ggml's vec_dot bit for bit in this build? Checked once
// on 5 rows x 7 columns of 256 values (every tile shape, 8 blocks).
bool agrees_with_ggml() {
    const int64_t n = 256, rows = 5, cols = 7;
    ggml_cpu_init();   // ggml's fp16 table, which its vec_dot reads (idempotent)
    const auto * t41 = ggml_get_type_traits_cpu(GGML_TYPE_Q4_1);
    const auto * t81 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_1);
    if (!t41 || !t81 || !t41->from_float || !t41->vec_dot || !t81->from_float || t41->vec_dot_type != GGML_TYPE_Q8_1) {
        return false;
    }
    const size_t xs = ggml_row_size(GGML_TYPE_Q4_1, n), ys = ggml_row_size(GGML_TYPE_Q8_1, n);
    std::vector<uint8_t> x(rows * xs), y(cols * ys);
    std::vector<float> v(n);
    uint32_t state = 12345u;
    auto next = [&state] {
        state = state * 1664525u + 1013904223u;
        return (float) (state >> 8) / (float) (1u << 24) - 0.5f;
    };
    for (int64_t r = 0; r < rows; ++r) {
        for (auto & e : v) {
            e = next() * (1.0f + (float) r);
        }
        t41->from_float(v.data(), x.data() + r * xs, n);
    }
    for (int64_t c = 0; c < cols; ++c) {
        for (auto & e : v) {
            e = next() * 3.0f;
        }
        t81->from_float(v.data(), y.data() + c * ys, n);
    }
    std::vector<float> ours(rows * cols), theirs(rows * cols);
    product(x.data(), xs, y.data(), ys, n, 0, rows, 0, cols, ours.data(), rows);
    for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows; ++r) {
            t41->vec_dot((int) n, &theirs[c * rows + r], 0, x.data() + r * xs, 0, y.data() + c * ys, 0, 1);
        }
    }
    return std::memcmp(ours.data(), theirs.data(), ours.size() * sizeof(float)) == 0;
}

bool enabled() {
    static const bool on = [] {
        if (!dream_switches_loaded().cpu_mul_mat) {
            return false;
        }
        if (!agrees_with_ggml()) {
            std::fprintf(stderr, "dreamstage: the batched Q4_1 kernel differs from ggml's vec_dot in this build; "
                                 "using ggml's\n");
            return false;
        }
        return true;
    }();
    return on;
}

} // namespace
#endif

extern "C" {

// The hook in ggml_compute_forward_mul_mat_one_chunk: computes rows
// [ir0_start, ir0_end) x columns [ir1_start, ir1_end) of dst and returns true,
// or returns false and leaves the chunk to ggml. wdata holds src1 converted to
// the weight's vec_dot type, one row of row_size bytes per column.
bool dream_cpu_mul_mat_chunk(const struct ggml_tensor * dst, const void * wdata, size_t row_size, int64_t ir0_start,
                             int64_t ir0_end, int64_t ir1_start, int64_t ir1_end) {
#ifdef DREAM_Q4_1_TILES
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * x = dst->src[1];
    // a batch (one column is ggml's own vec_dot: the same numbers, no gain),
    // 2-D operands, src1 quantized into wdata by ggml
    if (w->type != GGML_TYPE_Q4_1 || x->type != GGML_TYPE_F32 || ir1_end - ir1_start < 2 || w->ne[2] != 1 ||
        w->ne[3] != 1 || x->ne[2] != 1 || x->ne[3] != 1 || dst->nb[0] != sizeof(float) ||
        dst->nb[1] % sizeof(float) != 0 || !enabled()) {
        return false;
    }
    product((const uint8_t *) w->data, w->nb[1], (const uint8_t *) wdata, row_size, w->ne[0], ir0_start, ir0_end,
            ir1_start, ir1_end, (float *) dst->data, (int64_t) (dst->nb[1] / sizeof(float)));
    return true;
#else
    (void) dst; (void) wdata; (void) row_size; (void) ir0_start; (void) ir0_end; (void) ir1_start; (void) ir1_end;
    return false;
#endif
}

// For tests: out[c * n_rows + r] = x row r (Q4_1) . y column c (Q8_1) by the
// batched kernel; false where the kernel is not built or is switched off.
GGML_BACKEND_API bool dream_cpu_q4_1_product(const void * x, int64_t n_rows, const void * y, int64_t n_cols,
                                             int64_t n_in, float * out) {
#ifdef DREAM_Q4_1_TILES
    if (n_in <= 0 || n_in % QK4_1 != 0 || n_rows <= 0 || n_cols <= 0 || !enabled()) {
        return false;
    }
    product((const uint8_t *) x, ggml_row_size(GGML_TYPE_Q4_1, n_in), (const uint8_t *) y,
            ggml_row_size(GGML_TYPE_Q8_1, n_in), n_in, 0, n_rows, 0, n_cols, out, n_rows);
    return true;
#else
    (void) x; (void) n_rows; (void) y; (void) n_cols; (void) n_in; (void) out;
    return false;
#endif
}

}
