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
// L2), and multiplies the panel into a register tile of 32 columns x 8 tokens
// (16 columns x 6 tokens with AVX2), so each weight value is dequantized once per step and
// read from cache once per tile of tokens. The sums run over o in order, in
// float32, as OUT_PROD's do.
//
// On AVX-512 CPUs, Q4_0, Q4_1 and Q8_0 weights take a fused kernel instead
// (below): no float panel, a block dequantized straight into registers.
//
// The forward is ggml's quantized MUL_MAT, exactly what serving runs (for
// Q4_1 through the batched kernel of cpu/mul-mat-q4-1.cpp, which is ggml's
// arithmetic bit for bit); see docs/architecture/cpu.md.
#include "dream-stage.h"
#include "dream-testing.h"

#include "ggml-cpu.h"
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
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
// an 8-token tile (16 accumulators); AVX2 has 16 (below).
__attribute__((target("avx512f"))) void panel_product_avx512(const float * P, int64_t ni, int64_t no, int64_t o0,
        const float * dy, float * dx, int64_t n_tok, int64_t in_stride, int64_t out_stride, int64_t i0, bool acc) {
    panel_product_t<8>(P, ni, no, o0, dy, dx, n_tok, in_stride, out_stride, i0, acc);
}

// AVX2 in intrinsics: GCC lowers panel_product_t's 64-byte vectors through the
// stack when the target has no 64-byte registers (seen on an AVX2-only EPYC:
// 1.4 GFLOP/s, a 64-token step of the default model 7.7 s). A tile here is 16
// columns (two 8-float registers) x NT tokens: 2 NT accumulators, two weights
// and a broadcast within AVX2's 16 registers for NT <= 6. The sums run over o
// in order, as panel_product_t's do.
template <int NT>
__attribute__((target("avx2,fma"))) inline void panel_tile_avx2(const float * P, int64_t ni, int64_t no, const float * d,
                                                                  int64_t in_stride, float * out, int64_t out_stride,
                                                                  bool accumulate) {
    __m256 acc[NT][2];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = _mm256_setzero_ps();
        acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t o = 0; o < no; ++o) {
        const __m256 w0 = _mm256_loadu_ps(P + o * ni), w1 = _mm256_loadu_ps(P + o * ni + 8);
#pragma GCC unroll 6
        for (int t = 0; t < NT; ++t) {
            const __m256 b = _mm256_broadcast_ss(d + t * in_stride + o);
            acc[t][0] = _mm256_fmadd_ps(w0, b, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, b, acc[t][1]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        float * y = out + t * out_stride;
        if (accumulate) {
            acc[t][0] = _mm256_add_ps(_mm256_loadu_ps(y), acc[t][0]);
            acc[t][1] = _mm256_add_ps(_mm256_loadu_ps(y + 8), acc[t][1]);
        }
        _mm256_storeu_ps(y, acc[t][0]);
        _mm256_storeu_ps(y + 8, acc[t][1]);
    }
}

__attribute__((target("avx2,fma"))) void panel_product_avx2(const float * P, int64_t ni, int64_t no, int64_t o0,
        const float * dy, float * dx, int64_t n_tok, int64_t in_stride, int64_t out_stride, int64_t i0, bool acc) {
    constexpr int64_t TT = 6;
    for (int64_t t0 = 0; t0 < n_tok; t0 += TT) {
        const int nt = (int) std::min<int64_t>(TT, n_tok - t0);
        const float * d = dy + t0 * in_stride + o0;
        int64_t i = 0;
        for (; i + 16 <= ni; i += 16) {
            float * out = dx + t0 * out_stride + i0 + i;
            switch (nt) {
                case 1: panel_tile_avx2<1>(P + i, ni, no, d, in_stride, out, out_stride, acc); break;
                case 2: panel_tile_avx2<2>(P + i, ni, no, d, in_stride, out, out_stride, acc); break;
                case 3: panel_tile_avx2<3>(P + i, ni, no, d, in_stride, out, out_stride, acc); break;
                case 4: panel_tile_avx2<4>(P + i, ni, no, d, in_stride, out, out_stride, acc); break;
                case 5: panel_tile_avx2<5>(P + i, ni, no, d, in_stride, out, out_stride, acc); break;
                default: panel_tile_avx2<6>(P + i, ni, no, d, in_stride, out, out_stride, acc); break;
            }
        }
        for (; i < ni; ++i) {   // columns past the last full tile
            for (int t = 0; t < nt; ++t) {
                float sum = 0.0f;
                for (int64_t o = 0; o < no; ++o) {
                    sum += P[o * ni + i] * d[t * in_stride + o];
                }
                float * out = dx + (t0 + t) * out_stride + i0 + i;
                *out = acc ? *out + sum : sum;
            }
        }
    }
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

// Dequantization of the most common base types with AVX2 (ggml-base's own
// to_float is portable C, built without AVX2): at small chunks one
// dequantization pass over every weight is most of a step's backward (about
// 130 ms for the default model on one thread with to_float). Other types, and
// CPUs without AVX2, use to_float. The values are the same; d*q + m may round
// once (FMA) where to_float rounds twice.
__attribute__((target("avx2,fma,f16c"))) void dequant_q4_1_avx2(const uint8_t * src, float * y, int64_t n) {
    const auto * b = (const block_q4_1 *) src;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t k = 0; k < n / QK4_1; ++k, y += QK4_1) {
        uint16_t dm[2];
        std::memcpy(dm, &b[k], sizeof(dm));   // the block starts with d, then m (fp16)
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(dm[0])), m = _mm256_set1_ps(_cvtsh_ss(dm[1]));
        const __m128i q = _mm_loadu_si128((const __m128i *) b[k].qs);
        const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
        _mm256_storeu_ps(y + 0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m));
        _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m));
        _mm256_storeu_ps(y + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m));
        _mm256_storeu_ps(y + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m));
    }
}

__attribute__((target("avx2,fma,f16c"))) void dequant_q4_0_avx2(const uint8_t * src, float * y, int64_t n) {
    const auto * b = (const block_q4_0 *) src;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t k = 0; k < n / QK4_0; ++k, y += QK4_0) {
        uint16_t dh;
        std::memcpy(&dh, &b[k], sizeof(dh));
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
        const __m128i q = _mm_loadu_si128((const __m128i *) b[k].qs);
        const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
        const __m128i parts[4] = { lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8) };
        for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[j]), eight);
            _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(v), d));
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) void dequant_q8_0_avx2(const uint8_t * src, float * y, int64_t n) {
    const auto * b = (const block_q8_0 *) src;
    for (int64_t k = 0; k < n / QK8_0; ++k, y += QK8_0) {
        uint16_t dh;
        std::memcpy(&dh, &b[k], sizeof(dh));
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(dh));
        for (int j = 0; j < 4; ++j) {
            const __m128i q = _mm_loadl_epi64((const __m128i *) (b[k].qs + 8 * j));
            _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
    }
}

using dequant_fn = void (*)(const uint8_t *, float *, int64_t);

// the fastest dequantizer for a type on this CPU (null: use ggml's to_float)
dequant_fn fast_dequant(ggml_type type) {
    static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                             __builtin_cpu_supports("f16c");
    if (!avx2) {
        return nullptr;
    }
    switch (type) {
        case GGML_TYPE_Q4_0: return dequant_q4_0_avx2;
        case GGML_TYPE_Q4_1: return dequant_q4_1_avx2;
        case GGML_TYPE_Q8_0: return dequant_q8_0_avx2;
        default:             return nullptr;
    }
}

// The fused kernel (AVX-512, Q4_0 / Q4_1 / Q8_0): no float panel at all. A
// block of 32 weights is dequantized into two registers and multiplied into a
// register tile of 32 columns x NT tokens right away. The rows of a panel are
// walked once per block column, so a panel's quantized bytes are sized to stay
// in L1 (about 16 KiB) while its block columns are read in turn. At small
// chunks, where a step's backward is one pass over every weight, this is about
// 3x faster than writing and reading back a float panel; a token tile of more
// than 8 dequantizes the block again per 8 tokens.
// 32 nibbles (low ones: elements 0..15, high ones: 16..31) as q * d + bias
__attribute__((target("avx512f"), always_inline)) inline void nibbles(const uint8_t * qs, float d, float bias,
                                                                      __m512 & w0, __m512 & w1) {
    const __m128i q = _mm_loadu_si128((const __m128i *) qs), low4 = _mm_set1_epi8(0x0F);
    const __m512 dv = _mm512_set1_ps(d), bv = _mm512_set1_ps(bias);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4))), dv, bv);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4))), dv, bv);
}

__attribute__((target("f16c"), always_inline)) inline float fp16_at(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

struct deq_q4_0 {
    static constexpr size_t bytes = sizeof(block_q4_0);
    // (q - 8) d == fma(q, d, -8 d): both round the same real number once
    __attribute__((target("avx512f,f16c"), always_inline)) static inline void load(const uint8_t * p, __m512 & w0,
                                                                                     __m512 & w1) {
        const float d = fp16_at(p);
        nibbles(((const block_q4_0 *) p)->qs, d, -8.0f * d, w0, w1);
    }
};

struct deq_q4_1 {
    static constexpr size_t bytes = sizeof(block_q4_1);
    __attribute__((target("avx512f,f16c"), always_inline)) static inline void load(const uint8_t * p, __m512 & w0,
                                                                                     __m512 & w1) {
        nibbles(((const block_q4_1 *) p)->qs, fp16_at(p), fp16_at(p + 2), w0, w1);   // d, then m
    }
};

struct deq_q8_0 {
    static constexpr size_t bytes = sizeof(block_q8_0);
    __attribute__((target("avx512f,f16c"), always_inline)) static inline void load(const uint8_t * p, __m512 & w0,
                                                                                     __m512 & w1) {
        const auto * b = (const block_q8_0 *) p;
        const __m512 d = _mm512_set1_ps(fp16_at(p));
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) b->qs))), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (b->qs + 16)))), d);
    }
};

constexpr int64_t FUSED_MAX_TOKENS = 48;   // more tokens: the panel kernel (product_slabs says why)
constexpr int64_t FUSED_TT = 12;   // tokens per register tile: 24 accumulators + 2 weights + 1 broadcast of 32 registers

struct fused_args {
    const uint8_t * w;
    size_t row_bytes;
    int64_t n_in, n_out;
    const float * dy;   // [n_tok][n_out]
    float * dx;         // [n_tok][n_in]
};

// dx[t0 .. t0+NT][32 b .. 32 (b+nb)] (+)= sum over rows o0 .. o0+no of W[o][..] dy[t][o]
template <class D, int NT>
__attribute__((target("avx512f,f16c"))) void fused_tile(const fused_args & a, int64_t o0, int64_t no, int64_t b0,
                                                       int64_t nb, int64_t t0, bool accumulate) {
    const float * dy = a.dy + t0 * a.n_out;
    for (int64_t b = b0; b < b0 + nb; ++b) {
        __m512 acc[NT][2];
        for (int t = 0; t < NT; ++t) {
            acc[t][0] = _mm512_setzero_ps();
            acc[t][1] = _mm512_setzero_ps();
        }
        const uint8_t * p = a.w + (size_t) o0 * a.row_bytes + (size_t) b * D::bytes;
        for (int64_t o = o0; o < o0 + no; ++o, p += a.row_bytes) {
            __m512 w0, w1;
            D::load(p, w0, w1);
#pragma GCC unroll 12
            for (int t = 0; t < NT; ++t) {
                const __m512 g = _mm512_set1_ps(dy[t * a.n_out + o]);
                acc[t][0] = _mm512_fmadd_ps(w0, g, acc[t][0]);
                acc[t][1] = _mm512_fmadd_ps(w1, g, acc[t][1]);
            }
        }
        for (int t = 0; t < NT; ++t) {
            float * out = a.dx + (t0 + t) * a.n_in + 32 * b;
            if (accumulate) {
                acc[t][0] = _mm512_add_ps(_mm512_loadu_ps(out), acc[t][0]);
                acc[t][1] = _mm512_add_ps(_mm512_loadu_ps(out + 16), acc[t][1]);
            }
            _mm512_storeu_ps(out, acc[t][0]);
            _mm512_storeu_ps(out + 16, acc[t][1]);
        }
    }
}

template <class D>
void fused_tiles(const fused_args & a, int64_t o0, int64_t no, int64_t b0, int64_t nb, int64_t t0, int nt, bool acc) {
    switch (nt) {
        case 1: fused_tile<D, 1>(a, o0, no, b0, nb, t0, acc); break;
        case 2: fused_tile<D, 2>(a, o0, no, b0, nb, t0, acc); break;
        case 3: fused_tile<D, 3>(a, o0, no, b0, nb, t0, acc); break;
        case 4: fused_tile<D, 4>(a, o0, no, b0, nb, t0, acc); break;
        case 5: fused_tile<D, 5>(a, o0, no, b0, nb, t0, acc); break;
        case 6: fused_tile<D, 6>(a, o0, no, b0, nb, t0, acc); break;
        case 7: fused_tile<D, 7>(a, o0, no, b0, nb, t0, acc); break;
        case 8: fused_tile<D, 8>(a, o0, no, b0, nb, t0, acc); break;
        case 9: fused_tile<D, 9>(a, o0, no, b0, nb, t0, acc); break;
        case 10: fused_tile<D, 10>(a, o0, no, b0, nb, t0, acc); break;
        case 11: fused_tile<D, 11>(a, o0, no, b0, nb, t0, acc); break;
        default: fused_tile<D, 12>(a, o0, no, b0, nb, t0, acc); break;
    }
}

// Thread ith of nth takes a contiguous range of block columns (whole rows when
// alone), and walks the rows in panels whose quantized bytes fit L1.
template <class D>
void fused_product(const fused_args & a, int64_t n_tok, int ith, int nth) {
    const int64_t n_blocks = a.n_in / 32;
    const int64_t per = (n_blocks + nth - 1) / nth;
    const int64_t b0 = per * ith, nb = std::min(per, n_blocks - b0);
    if (nb <= 0) {
        return;
    }
    const int64_t oc = std::max<int64_t>(8, (16 * 1024) / (int64_t) (nb * D::bytes));
    const size_t seg = (size_t) nb * D::bytes;
    for (int64_t o0 = 0; o0 < a.n_out; o0 += oc) {
        const int64_t no = std::min(oc, a.n_out - o0);
        // the next panel's rows into L2 while this one is multiplied (the
        // rows are read a block column at a time, which the hardware
        // prefetcher does not follow across rows)
        const int64_t nn = std::min(oc, a.n_out - o0 - no);
        for (int64_t o = 0; o < nn; ++o) {
            const char * r = (const char *) a.w + (size_t) (o0 + no + o) * a.row_bytes + (size_t) b0 * D::bytes;
            for (size_t off = 0; off < seg; off += 64) {
                _mm_prefetch(r + off, _MM_HINT_T1);
            }
        }
        for (int64_t t0 = 0; t0 < n_tok; t0 += FUSED_TT) {
            fused_tiles<D>(a, o0, no, b0, nb, t0, (int) std::min<int64_t>(FUSED_TT, n_tok - t0), o0 > 0);
        }
    }
}

// the fused kernel for a type on this CPU, or null (the panel kernel then)
using fused_fn = void (*)(const fused_args &, int64_t, int, int);
fused_fn fused_kernel(ggml_type type) {
    // DREAMSTAGE_CPU_BACKWARD=panel keeps the panel kernel (tests cover both)
    static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") &&
                               dream_switches_loaded().cpu_backward_fused;
    if (!avx512) {
        return nullptr;
    }
    switch (type) {
        case GGML_TYPE_Q4_0: return fused_product<deq_q4_0>;
        case GGML_TYPE_Q4_1: return fused_product<deq_q4_1>;
        case GGML_TYPE_Q8_0: return fused_product<deq_q8_0>;
        default:             return nullptr;
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
    // above about 48 tokens a float panel, dequantized once and read by every
    // token tile, beats dequantizing per tile of 12 (measured in a step of the
    // default model, one thread: chunk 32 fused 286 ms, panel 328; chunk 64
    // equal; chunk 128 fused 1,034, panel 980; chunk 256 fused 2,200, panel 1,990)
    if (const fused_fn fused = s.n_tok <= FUSED_MAX_TOKENS ? fused_kernel(type) : nullptr) {
        fused({ w, s.row_bytes, s.n_in, s.n_out, dy, dx }, s.n_tok, ith, nth);
        return;
    }
    const ggml_to_float_t to_float = ggml_get_type_traits(type)->to_float;
    const dequant_fn fast = fast_dequant(type);
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
                const uint8_t * row = w + (size_t) (o0 + o) * s.row_bytes + col_bytes;
                if (fast) {
                    fast(row, panel.data() + o * ni, ni);
                } else {
                    to_float(row, panel.data() + o * ni, ni);
                }
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
